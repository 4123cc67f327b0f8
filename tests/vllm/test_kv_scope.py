"""The pieces of lora_guard.vllm's KV scope that need no vLLM: who the tenant is, and the
adapter's version as the bundled engine names it (integration/test_vllm_plugin.py runs it in
vLLM)."""

from __future__ import annotations

import shutil
from pathlib import Path

from transformers import AutoConfig

from lora_guard.demo.testing import AdapterFactory
from lora_guard.engine.lora.checkpoint import read_adapter
from lora_guard.engine.spec import ModelSpec
from lora_guard.vllm.kv_scope import AdapterDigests, salt_of, tenant_of


def test_the_tenant_is_the_key_and_the_tenant_header_together() -> None:
    assert tenant_of({}) == "default"
    assert tenant_of({"x-tenant-id": "acme"}) == "acme"
    assert tenant_of({"x-gateway-inference-fairness-id": "acme"}) == "acme"
    one, other = (
        tenant_of({"authorization": "Bearer k1"}),
        tenant_of({"authorization": "Bearer k2"}),
    )
    assert one != other and "k1" not in one  # a key is named by its digest, never itself
    named = tenant_of({"authorization": "Bearer k1", "x-tenant-id": "acme"})
    assert named.startswith(one) and named.endswith("/acme")  # a header cannot leave its key


def test_an_adapters_digest_is_the_engines_content_hash_and_follows_its_files(
    tiny_model: Path, tiny_adapters: AdapterFactory, tmp_path: Path
) -> None:
    first, second = tiny_adapters(2, "scope").values()
    folder = tmp_path / "a"
    shutil.copytree(first, folder)
    spec = ModelSpec.from_config(AutoConfig.from_pretrained(tiny_model))
    digests = AdapterDigests()
    before = digests.of(folder)
    assert before == read_adapter("a", folder, spec, 64).content_hash
    shutil.copyfile(second / "adapter_model.safetensors", folder / "adapter_model.safetensors")
    assert digests.of(folder) == read_adapter("a", folder, spec, 64).content_hash != before
    assert digests.of(tmp_path / "missing") is None


def test_a_salt_is_one_vllm_accepts() -> None:
    salt = salt_of(("base", "tiny", "adapter", "a"))
    assert len(salt) <= 128 and salt.isalnum()
    assert salt != salt_of(("base", "tiny", "adapter", "b"))

"""The PEFT peer's continuous batching: requests that join a running batch, each with its own
adapter and length, get the tokens they would get alone from transformers' ``generate``."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from lora_guard.bench.peft_server import PeftWorker, _Ask
from lora_guard.demo.testing import AdapterFactory


def test_requests_joining_a_running_batch_get_what_generate_gives_each_alone(
    tiny_model: Path, tiny_adapters: AdapterFactory
) -> None:
    folders = tiny_adapters(2, "cb", ranks=(4, 8), all_projections=True)
    names = sorted(folders)
    worker = PeftWorker(str(tiny_model), str(folders[names[0]].parent), names, "float32")
    asked = [  # prompt, adapter, tokens: lengths and adapters differ, the base model too
        ([5, 6, 7, 8, 9, 10, 11], names[0], 40),
        ([12, 13], names[1], 5),
        ([14, 15, 16, 17], None, 9),
        ([18, 19, 20], names[0], 1),
        ([21, 22, 23, 24, 25, 26, 27, 28, 29], names[1], 7),
    ]

    async def run() -> list[list[int]]:
        loop = asyncio.get_running_loop()
        asks = [_Ask(prompt, adapter, n, loop) for prompt, adapter, n in asked]
        worker.waiting.put(asks[0])
        first = await asyncio.wait_for(asks[0].out.get(), 60)
        for ask in asks[1:]:  # they join a batch already running
            worker.waiting.put(ask)
        joined_at = asks[0].sent
        done = await asyncio.wait_for(asyncio.gather(*map(tokens, asks)), 120)
        assert joined_at < asked[0][2]  # the first was still running when the others came
        return [[first, *done[0]], *done[1:]]

    async def tokens(ask: _Ask) -> list[int]:
        out = []
        while (token := await ask.out.get()) is not None:
            out.append(token)
        return out

    got = asyncio.run(run())
    model = worker.model
    for (prompt, adapter, n), tokens in zip(asked, got, strict=True):
        with torch.no_grad():
            alone = model.generate(
                input_ids=torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=worker.pad,
                adapter_names=[adapter or "__base__"],
            )
        assert tokens == alone[0, len(prompt) :].tolist(), (adapter, n)
    assert not worker.batch.asks and worker.batch.cache is None  # nothing left running

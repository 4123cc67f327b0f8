"""Engine configuration, validated when it is made.

Each field a user sets is described once, in ``setting(...)`` metadata: its help, how a value is
read and checked, and what the command line needs. ``LLM(...)``'s keywords, the flags of
``lora-guard serve`` (``lora_guard.config``) and the docs' tables come from these fields. Fields
without help (``lora_mode``, ...) are set by the engine's builder, never by users.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from lora_guard.clock import monotonic
from lora_guard.engine.values import (
    ConfigError,
    at_least,
    device_name,
    dtype_name,
    one_of,
    parse_memory,
    power_of_two,
    resolve_device,
    resolve_dtype,
    text,
)

# torch is imported where a device or a dtype is resolved (the engine being made), not here: the
# command line reads and checks its flags, and the docs' tables are made, without it.
if TYPE_CHECKING:
    import torch

# -- fields -------------------------------------------------------------------------------------


def setting(
    default: Any = MISSING,
    *,
    help: str,
    check: Callable[[Any], Any] | None = None,
    metavar: str | None = None,
    shown: str | None = None,
    flag: str | None = None,
    group: str = "engine",
) -> Any:
    """A field users set. ``help`` and ``shown`` (the default in words) may name other fields as
    ``{max_loras}``: a flag on the command line, a keyword in ``LLM``'s docs. ``check`` reads and
    checks a value, Python or a flag's text. ``flag`` is the setting's name on the command line
    where it differs from the field's; a bool field is a switch there (``--no-...`` when on by
    default). ``group`` is its section of ``lora-guard serve --help``."""
    metadata = {
        "help": help,
        "check": check,
        "metavar": metavar,
        "shown": shown,
        "flag": flag,
        "group": group,
    }
    return field(default=default, metadata=metadata)


def count(default: int | None, least: int, help: str, **more: Any) -> Any:
    """A setting that counts something: a whole number of at least ``least``."""
    return setting(default, help=help, check=at_least(least), metavar="N", **more)


@dataclass(frozen=True, slots=True)
class Order:
    """``low <= high`` between two settings (``low < high`` when ``strict``); None passes. With
    ``follow``, a ``high`` left at its default is raised to ``low`` instead of failing."""

    low: str
    high: str
    strict: bool = False
    follow: bool = False

    def settle(self, values: dict[str, Any], at_default: Callable[[str], bool]) -> bool:
        """Whether ``values`` keep the order, once a following ``high`` is raised in place."""
        low, high = values[self.low], values[self.high]
        if low is None or high is None or (low < high if self.strict else low <= high):
            return True
        if self.follow and at_default(self.high):
            values[self.high] = low
            return True
        return False

    def message(self, spell: Callable[[str], str] = str) -> str:
        if self.strict:
            return f"{spell(self.low)} must be less than {spell(self.high)}"
        return f"{spell(self.high)} must be at least {spell(self.low)}"


#: The engine's rules between fields; ``lora_guard.config`` checks the same ones with flag names.
ORDERS = (
    Order("max_loras", "max_cpu_loras", follow=True),
    Order("block_size", "max_batch_tokens"),
)


@dataclass(slots=True)
class EngineConfig:
    """Sizes and switches of one engine instance."""

    model: str = setting(
        help="Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer)",
        check=text,
        metavar="DIR",
        group="model",
        shown="the demo model, prepared if missing",
    )
    model_id: str | None = setting(
        None,
        help="name of the base model in /info, /v1/models and the OpenAI `model` field",
        check=text,
        metavar="NAME",
        group="model",
        shown="from the checkpoint",
    )
    device: str | torch.device = setting(
        "auto", help="cpu, cuda, cuda:N, mps or auto (cuda when available)", check=device_name
    )
    dtype: str | torch.dtype = setting(
        "auto",
        help="float32, bfloat16, float16 (also fp32, bf16, "
        "fp16, half) or auto (bfloat16 on cuda, float32 on cpu)",
        check=dtype_name,
    )
    lora_dtype: str | torch.dtype = setting(
        "auto",
        help="how adapter weights are stored in the "
        "cache pool: float32, bfloat16, float16 (rounded "
        "once when read, computed in {dtype}) or auto (as "
        "{dtype})",
        check=dtype_name,
    )
    max_loras: int = count(
        0,
        0,
        "most adapters resident in the cache pool at once; 0: no cap, the pool's pages alone "
        "bound them",
    )
    max_cpu_loras: int = count(
        32,
        1,
        "adapters kept in host memory; left at its default it is raised to {max_loras}, set lower "
        "it is an error",
    )
    max_lora_rank: int = count(
        64,
        1,
        "largest adapter rank accepted (adapters take pages for their own ranks, never this one)",
    )
    cache_memory: int | str | None = setting(
        None,
        help="the one cache pool that KV blocks and "
        "adapter weights share, bytes or a size such as "
        "512MiB, 2GB, 1.5GiB; memory for both never exceeds "
        "it",
        check=parse_memory,
        metavar="SIZE",
        shown="{kv_cache_memory}, else what {max_num_seqs} requests and the adapters "
        "need, at most a quarter of free memory",
    )
    kv_cache_memory: int | str | None = setting(
        None,
        help="the cache pool under its former name, used when {cache_memory} is not given",
        check=parse_memory,
        metavar="SIZE",
        shown="sized to the work",
    )
    adapter_memory: int | str | None = setting(
        None,
        help="part of {cache_memory} kept for adapter weights "
        "alone, as vLLM and SGLang keep adapter seats beside "
        "the KV: KV never takes it and adapters never take KV's "
        "pages; bytes or a size such as 64MiB",
        check=parse_memory,
        metavar="SIZE",
        shown="none: KV and adapters share every page",
    )
    residency_quantum_ms: int = setting(
        1000,
        help="an adapter that requests still need stays in "
        "the pool at least this long after its load: adapters "
        "take turns at step boundaries instead of thrashing",
        check=at_least(0),
        metavar="MS",
    )
    lora_compute: str = setting(
        "auto",
        help="how a step computes the LoRA updates: kernel (the "
        "compiled kernel, one call per projection; a float32 or "
        "bfloat16 model on the CPU, from float32 or bfloat16 adapter "
        "pages), loop (per "
        "adapter segment), batched (one gathered batched matmul per "
        "projection), auto (kernel where it builds, else loop)",
        check=one_of("auto", "kernel", "loop", "batched"),
        metavar="MODE",
    )
    weight_layout: str = setting(
        "auto",
        help="how the base model's projections are stored: "
        "blocked (oneDNN's layout, float32 or bfloat16 on the CPU), plain (torch.mm "
        "over [in, out]), auto (blocked where it applies, else plain; on a CPU where the "
        "compiled operations build, each weight's rows kept beside it for decode steps of a "
        "few sequences: twice the weights' memory, docs/engine.md)",
        check=one_of("auto", "blocked", "plain"),
        metavar="LAYOUT",
    )
    block_size: int = setting(
        16, help="tokens per KV block (a power of two)", check=power_of_two, metavar="N"
    )
    enable_prefix_caching: bool = setting(
        True,
        help="reuse KV blocks of shared prefixes (within one namespace)",
        flag="no_prefix_caching",
    )
    max_batch_tokens: int = count(
        2048, 1, "tokens per engine step, prefill and decode together; at least {block_size}"
    )
    max_num_seqs: int = count(64, 1, "sequences in the running batch at once")
    max_model_len: int | None = count(
        None,
        2,
        "longest prompt + generated tokens of one request",
        shown="the model's context length",
        flag="max_total_tokens",
    )
    step_log: str | None = setting(
        None,
        help="append one JSON line a step to this file (when, "
        "sequences, adapter bytes read, prefill tokens, loads, "
        "seconds): a step log to fit `lora-guard simulate`'s step cost "
        "to; past 64 MiB it becomes FILE.1 and a new FILE begins",
        check=text,
        metavar="FILE",
    )
    lora_mode: str = "slots"
    static_adapter: str | None = None
    reject_when_busy: bool = True  # False: a policy's "busy" makes a request wait (LLM.generate)
    #: the engine's time in seconds: arrivals, heat windows, the residency quantum and the state
    #: view's ``now`` read it (durations measured for reports stay on ``timer``)
    clock: Callable[[], float] = monotonic

    def __post_init__(self) -> None:
        for f in user_fields():
            value = getattr(self, f.name)
            if f.metadata["check"] is not None and value is not None:
                try:
                    setattr(self, f.name, f.metadata["check"](value))
                except ValueError as exc:
                    raise ConfigError(f"{f.name}: {exc}") from None
        values = {f.name: getattr(self, f.name) for f in user_fields()}
        for order in ORDERS:
            if not order.settle(values, lambda name: values[name] == _DEFAULTS[name]):
                raise ConfigError(order.message())
            setattr(self, order.high, values[order.high])
        if self.lora_mode not in ("slots", "merged"):
            raise ConfigError(f"lora_mode must be slots or merged, not {self.lora_mode!r}")
        if self.static_adapter is not None:
            self.lora_mode = "merged"
        self.device = resolve_device(self.device)
        self.dtype = resolve_dtype(self.dtype, self.device)
        if self.lora_dtype == "auto":
            self.lora_dtype = self.dtype
        self.lora_dtype = resolve_dtype(self.lora_dtype, self.device)

    @property
    def torch_device(self) -> torch.device:
        import torch

        assert isinstance(self.device, torch.device)
        return self.device

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        assert isinstance(self.dtype, torch.dtype)
        return self.dtype

    @property
    def torch_lora_dtype(self) -> torch.dtype:
        import torch

        assert isinstance(self.lora_dtype, torch.dtype)
        return self.lora_dtype

    def cache_bytes(self) -> int | None:
        """The cache pool's size when one is set (KV blocks and adapter weights share it); None:
        the engine sizes it to the work (``lora_guard.engine.pool_size``)."""
        for size in (self.cache_memory, self.kv_cache_memory):
            if size is not None:
                return int(size)
        return None


def user_fields() -> Iterator[Field[Any]]:
    """The fields of ``EngineConfig`` that users set (those with help)."""
    return (f for f in fields(EngineConfig) if "help" in f.metadata)


def describe(words: str, spell: Callable[[str], str]) -> str:
    """``words`` with each ``{field}`` spelled by ``spell`` (a flag, or a keyword)."""
    return re.sub(r"\{(\w+)\}", lambda m: spell(m.group(1)), words)


_DEFAULTS = {f.name: f.default for f in user_fields()}

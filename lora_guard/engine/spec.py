"""What the engine knows of a model's architecture (``ModelSpec``, read from ``config.json``) and
which projections carry LoRA (``FUSED_PROJECTIONS``): shared by the model and the LoRA code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
# Each fused projection and the PEFT module names it is made of, in output order.
FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
LORA_TARGETS = tuple(m for group in FUSED_PROJECTIONS.values() for m in group)


def projection_shape(
    module: str, hidden: int, q_width: int, kv_width: int, intermediate: int
) -> tuple[int, int]:
    """(in_features, out_features) of a Llama layer's projection ``module``."""
    return {
        "q_proj": (hidden, q_width),
        "k_proj": (hidden, kv_width),
        "v_proj": (hidden, kv_width),
        "o_proj": (q_width, hidden),
        "gate_proj": (hidden, intermediate),
        "up_proj": (hidden, intermediate),
        "down_proj": (intermediate, hidden),
    }[module]


class ModelLoadError(ValueError):
    """The checkpoint cannot be served: wrong architecture, pickle weights, missing tensors."""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The architecture facts the engine needs, read from ``config.json``."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    max_position_embeddings: int
    sliding_window: int | None

    @classmethod
    def from_config(cls, config: Any) -> ModelSpec:
        model_type = config.model_type
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"model type {model_type!r} is not supported; lora-guard serves "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        heads = config.num_attention_heads
        attention_bias = bool(getattr(config, "attention_bias", False))
        window = getattr(config, "sliding_window", None) if model_type != "llama" else None
        if model_type == "qwen2" and not getattr(config, "use_sliding_window", False):
            window = None
        return cls(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            rms_norm_eps=config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            max_position_embeddings=config.max_position_embeddings,
            sliding_window=window,
        )

    def module_shape(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a LoRA-targetable projection."""
        return projection_shape(
            module,
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
            self.intermediate_size,
        )

    def fused_rows(self, module: str) -> tuple[str, int, int]:
        """The fused projection that holds ``module``, and the output rows it occupies there."""
        for projection, modules in FUSED_PROJECTIONS.items():
            if module in modules:
                start = sum(self.module_shape(m)[1] for m in modules[: modules.index(module)])
                return projection, start, start + self.module_shape(module)[1]
        raise KeyError(module)

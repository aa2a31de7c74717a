"""What adapters may be, without torch (the flags are checked with it, in the server's first second):
the projections an adapter may target, the ranks the server may allow, the server's limits, and
the base model's shapes an adapter is checked against."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Sonar's fused linear layers of a decoder layer: the module each lives in and the projections
#: an adapter may target in it, in the order of its output columns.
FUSED: dict[str, tuple[str, tuple[str, ...]]] = {
    "qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "o_proj": ("self_attn", ("o_proj",)),
    "gate_up_proj": ("mlp", ("gate_proj", "up_proj")),
    "down_proj": ("mlp", ("down_proj",)),
}
#: The projections an adapter may target, with the fused layer each belongs to.
MODULES: dict[str, str] = {module: fused for fused, (_, modules) in FUSED.items() for module in modules}
#: ``--lora-target-modules`` names: the projections, or the fused layers (all their projections).
TARGET_NAMES = (*MODULES, "qkv_proj", "gate_up_proj")

MAX_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class LoRALimits:
    """What the server accepts: ``--max-lora-rank`` and ``--lora-target-modules`` (None: all)."""

    max_rank: int = 16
    target_modules: frozenset[str] | None = None

    def targets(self, module: str) -> bool:
        """Whether the server applies adapters to projection `module` (a key of `MODULES`)."""
        allowed = self.target_modules
        return allowed is None or module in allowed or MODULES[module] in allowed


@dataclass(frozen=True)
class ModelShapes:
    """The base model's projections: ``(in_features, out_features)`` by `MODULES` name (whole,
    not a tensor-parallel rank's share), and its number of decoder layers."""

    modules: dict[str, tuple[int, int]]
    num_layers: int

    @classmethod
    def of_config(cls, config: Any) -> "ModelShapes":
        """From a decoder's Hugging Face config (`sonar.models.decoder` serves those)."""
        hidden = config.hidden_size
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        kv = (config.num_key_value_heads or heads) * head_dim
        inter = config.intermediate_size
        return cls(
            modules={
                "q_proj": (hidden, heads * head_dim),
                "k_proj": (hidden, kv),
                "v_proj": (hidden, kv),
                "o_proj": (heads * head_dim, hidden),
                "gate_proj": (hidden, inter),
                "up_proj": (hidden, inter),
                "down_proj": (inter, hidden),
            },
            num_layers=config.num_hidden_layers,
        )

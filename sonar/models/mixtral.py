"""Mixtral: Mistral's layers with a sparse block of ``num_local_experts`` experts in each, top-2
(``num_experts_per_tok``) routing renormalized over the chosen experts, no shared expert.

Checkpoints name the block ``block_sparse_moe`` and an expert's projections ``w1`` (gate), ``w3``
(up) and ``w2`` (down); `checkpoint_name` maps them onto Sonar's (transformers' own) ``mlp.``,
``gate_proj``, ``up_proj`` and ``down_proj``.
"""

from __future__ import annotations

import re
from typing import Any

from sonar.models.moe import MoeForCausalLM, MoeSpec

_EXPERT_PROJECTION = re.compile(r"\.experts\.(\d+)\.w([123])\.")
_PROJECTIONS = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


class MixtralForCausalLM(MoeForCausalLM):
    architectures = ("MixtralForCausalLM",)

    @classmethod
    def moe_spec(cls, config: Any) -> MoeSpec:
        return MoeSpec(
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            intermediate=config.intermediate_size,
            renormalize=True,
        )

    def checkpoint_name(self, name: str) -> str:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        return _EXPERT_PROJECTION.sub(lambda m: f".experts.{m[1]}.{_PROJECTIONS[m[2]]}.", name)

"""Qwen3-VL MoE: Qwen3-VL's tower, DeepStack and interleaved M-RoPE over Qwen3-MoE's decoder.

Everything that sees pictures is Qwen3-VL's (`sonar.models.qwen3_vl`); the decoder's layers are
Qwen3-MoE's (`sonar.models.qwen_moe`): Qwen3's attention (q/k norms, explicit ``head_dim``), a
sparse block of ``num_experts`` experts (``moe_intermediate_size`` each, no shared expert) in
every layer but those of ``mlp_only_layers`` or off ``decoder_sparse_step``, which keep a dense
MLP of ``intermediate_size``. The router always renormalizes its top-``num_experts_per_tok``
weights: the config has no ``norm_topk_prob`` (transformers' ``Qwen3VLMoeTextTopKRouter``).

**Checkpoint.** Names as Qwen3-VL's (``model.visual.*``, ``model.language_model.*``,
``lm_head.*``); each sparse block's experts are two stacked tensors, ``mlp.experts.gate_up_proj``
and ``mlp.experts.down_proj``, which the published checkpoints store transposed against the
layout transformers keeps in memory (and writes with ``save_pretrained``): ``[E, hidden, 2 I]``
and ``[E, I, hidden]`` instead of ``[E, 2 I, hidden]`` and ``[E, hidden, I]``. As transformers
reads them, a tensor whose shape is not the in-memory one is transposed (`_experts_in_memory_layout`);
where both layouts have one shape (``hidden == 2 I``) the tensor is taken as in memory.

Served as Qwen3-VL is: not with tensor (so not expert) or pipeline parallelism, quantized weights
or EAGLE; nor with LoRA, whose adapters target dense MLPs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

from torch import Tensor

from sonar.models.decoder import EAGLE, LORA, QUANTIZED, DecoderVariant
from sonar.models.moe import MoeForCausalLM, MoeSpec
from sonar.models.qwen2_vl import Qwen2_5_VLForConditionalGeneration
from sonar.models.qwen3_vl import Qwen3VLForConditionalGeneration
from sonar.models.qwen_moe import Qwen3MoeForCausalLM

_STACKED_EXPERTS = re.compile(r".*\.mlp\.experts\.(gate_up_proj|down_proj)")


class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration, Qwen3MoeForCausalLM):
    """Qwen3-VL with Qwen3-MoE's sparse blocks (see the module docstring). The vision half comes
    from `Qwen3VLForConditionalGeneration`, the MoE half (the sparse layers, their loading) from
    `Qwen3MoeForCausalLM`, next in the method order after the dense Qwen-VL classes."""

    architectures = ("Qwen3VLMoeForConditionalGeneration",)
    refused: ClassVar[dict[str, str]] = {
        **Qwen3VLForConditionalGeneration.refused,
        LORA: MoeForCausalLM.refused[LORA],
        QUANTIZED: "not implemented for Qwen3-VL MoE yet",
        EAGLE: MoeForCausalLM.refused[EAGLE],
    }

    @classmethod
    def make_variant(cls, config: Any) -> DecoderVariant:
        """Qwen3-MoE's: Qwen3-VL's attention switches (the same), its sparse blocks as `mlp_factory`."""
        return super(Qwen2_5_VLForConditionalGeneration, cls).make_variant(config)

    @classmethod
    def moe_spec(cls, config: Any) -> MoeSpec:
        return MoeSpec(
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            intermediate=config.moe_intermediate_size,
            renormalize=True,
        )

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        return super().load_weights(self._experts_in_memory_layout(weights))

    def _experts_in_memory_layout(self, weights: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        """The stacked expert tensors as ``[E, 2 I, hidden]`` / ``[E, hidden, I]``: a published
        checkpoint's transposed ones turned (a view), the others as they are."""
        hidden, inter = self.config.hidden_size, self.config.moe_intermediate_size
        expected = {"gate_up_proj": (2 * inter, hidden), "down_proj": (hidden, inter)}
        for name, tensor in weights:
            found = _STACKED_EXPERTS.fullmatch(name)
            if found is not None and tensor.dim() == 3:
                rows, cols = expected[found[1]]
                if tuple(tensor.shape[1:]) == (cols, rows) != (rows, cols):
                    tensor = tensor.transpose(1, 2)
            yield name, tensor

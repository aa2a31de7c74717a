"""Qwen3-VL (dense): Qwen2-VL's design with a new tower, DeepStack and interleaved M-RoPE, over Qwen3's decoder.

**Vision tower.** The processor is Qwen2-VL's (`sonar.multimodal.qwen2_vl`; Qwen3-VL's checkpoints
cut 16-pixel patches, merged 2x2, two frames a patch). A Conv3d (with a bias) embeds each patch;
a learned position table of ``side x side`` entries (``num_position_embeddings``), resampled
bilinearly (corners aligned) to the image's grid of patches, is added; the blocks (LayerNorms,
a two-layer MLP) rotate queries and keys by the patch's (row, column) as Qwen2-VL's do and attend
over the whole frame. The merger (LayerNorm, then an MLP over each ``merge x merge`` block's
patches side by side) gives one row per ``<|image_pad|>`` token.

**DeepStack.** After each block of ``deepstack_visual_indexes`` another merger (its LayerNorm over
the block's patches side by side) gives a second set of rows; the decoder adds set ``i`` to the
hidden states of the image's token rows after its layer ``i``. `encode_grid` returns an image's
rows with its DeepStack rows beside them (``[rows, hidden * (1 + len(deepstack))]``), so the
runner's slicing of an image's rows for a chunk (a chunked prefill, a prefix-cache hit inside the
image) carries the matching DeepStack rows with it; `forward` splits them again. A step that
embeds no image rows has nothing to add: the rows before it are in the KV cache already.

**M-RoPE** is Qwen2-VL's positions (`sonar.models.qwen2_vl.rope_index`) with the frequencies'
three sections interleaved (`sonar.models.rotary.mrope_owner`), as transformers always takes them
for this family.

The MoE variant is `sonar.models.qwen3_vl_moe`. Pipeline parallelism is refused: a stage after
the first would need the DeepStack rows of its layers.

Checkpoint names: ``model.visual.*`` (``pos_embed``, ``blocks.*``, ``merger.*``,
``deepstack_merger_list.*``), ``model.language_model.*``, ``lm_head.*``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sonar.kernels.attention import AttentionMetadata
from sonar.kernels.attention_op import step_metadata
from sonar.models.decoder import (
    EAGLE,
    LORA,
    PIPELINE_PARALLEL,
    QUANTIZED,
    TENSOR_PARALLEL,
    DecoderVariant,
    sliding_windows,
)
from sonar.models.errors import ModelLoadError
from sonar.models.llava import ACTIVATIONS
from sonar.models.parallel import SINGLE, WHOLE, PipelineStage, TensorParallel
from sonar.models.qwen2_vl import PatchEmbed, Qwen2_5_VLForConditionalGeneration, VisionAttention, patch_positions
from sonar.protocol.engine import VisionInfo

_NOT_YET = "not implemented for Qwen3-VL yet"


class VisionMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ModelLoadError(f"vision hidden_act {act!r} is not supported (one of {', '.join(ACTIVATIONS)})")
        self.act = ACTIVATIONS[act]
        self.linear_fc1 = nn.Linear(hidden, intermediate)
        self.linear_fc2 = nn.Linear(intermediate, hidden)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = VisionAttention(config.hidden_size, config.num_heads)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.mlp = VisionMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, lengths: list[int]) -> Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """`merge x merge` patches side by side to one row; `postshuffle`: the norm over the whole
    row (DeepStack's mergers) rather than over each patch (the main one)."""

    def __init__(self, config: Any, postshuffle: bool) -> None:
        super().__init__()
        self.width = config.hidden_size * config.spatial_merge_size**2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.width if postshuffle else config.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, config.out_hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        x = self.norm(x.view(-1, self.width)) if self.postshuffle else self.norm(x).view(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionTransformer(nn.Module):
    """Qwen3-VL's tower, its merger and DeepStack mergers (see the module docstring)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.merge = config.spatial_merge_size
        self.side = int(config.num_position_embeddings**0.5)
        if self.side * self.side != config.num_position_embeddings:
            raise ModelLoadError(f"vision num_position_embeddings {config.num_position_embeddings} is not a square")
        rope = getattr(config, "rope_parameters", None) or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ModelLoadError(f"vision rope_type {rope['rope_type']!r} is not supported (axial)")
        head_dim = config.hidden_size // config.num_heads
        axis = head_dim // 2  # each axis (row, column) turns half of a head's dimensions
        theta = float(rope.get("rope_theta", 10000.0))
        with torch.device("cpu"):
            self.inv_freq = 1.0 / theta ** (torch.arange(0, axis, 2, dtype=torch.float32) / axis)
        self.patch_embed = PatchEmbed(config, config.hidden_size, bias=True)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config, postshuffle=False)
        self.deepstack_visual_indexes = [int(i) for i in config.deepstack_visual_indexes]
        if not all(0 <= i < config.depth for i in self.deepstack_visual_indexes):
            raise ModelLoadError(
                f"vision deepstack_visual_indexes {self.deepstack_visual_indexes} are outside the {config.depth} blocks"
            )
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(config, postshuffle=True) for _ in self.deepstack_visual_indexes
        )

    def positions(self, grid: Sequence[int]) -> Tensor:
        """The learned position table resampled to the grid ``[t * h * w, hidden]``, in the processor's
        patch order (each ``merge x merge`` block consecutive), the same for every frame."""
        t, h, w = grid
        table = self.pos_embed.weight.view(self.side, self.side, -1).permute(2, 0, 1)[None]
        table = F.interpolate(table.float(), size=(h, w), mode="bilinear", align_corners=True)[0]
        m = self.merge
        table = table.permute(1, 2, 0).reshape(h // m, m, w // m, m, -1).transpose(1, 2).reshape(h * w, -1)
        return table.repeat(t, 1)

    def forward(self, pixels: Tensor, grid: Sequence[int]) -> Tensor:
        """One image's patches to its rows and DeepStack rows side by side ``[t * h * w / merge ** 2,
        out * (1 + len(deepstack_visual_indexes))]``."""
        t, h, w = grid
        x = self.patch_embed(pixels)
        x = x + self.positions(grid).to(x.device, x.dtype)
        angles = patch_positions(grid, self.merge).to(x.device)[..., None].float() * self.inv_freq.to(x.device)
        angles = angles.flatten(1)
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        frames = [h * w] * t
        deep: list[Tensor] = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames)
            if i in self.deepstack_visual_indexes:
                deep.append(self.deepstack_merger_list[self.deepstack_visual_indexes.index(i)](x))
        return torch.cat([self.merger(x), *deep], dim=-1)


class Qwen3VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    """Qwen3-VL: the tower with DeepStack, then Qwen3's decoder with interleaved M-RoPE."""

    architectures = ("Qwen3VLForConditionalGeneration",)
    refused: ClassVar[dict[str, str]] = {
        TENSOR_PARALLEL: _NOT_YET,
        PIPELINE_PARALLEL: "not implemented for Qwen3-VL: its DeepStack rows feed the first layers' hidden states",
        LORA: _NOT_YET,
        QUANTIZED: _NOT_YET,
        EAGLE: _NOT_YET,
    }

    def __init__(self, config: Any, parallel: TensorParallel = SINGLE, stage: PipelineStage = WHOLE) -> None:
        super().__init__(config, parallel, stage)
        self.rotary.interleave_mrope()
        self.deepstack = len(self.visual.deepstack_visual_indexes)
        if self.deepstack > len(self.own_layers):
            raise ModelLoadError(
                f"{self.deepstack} DeepStack feature sets for a decoder of {len(self.own_layers)} layers"
            )

    @staticmethod
    def make_tower(vision: Any) -> nn.Module:
        return VisionTransformer(vision)

    @classmethod
    def prepare_config(cls, config: Any) -> None:
        super().prepare_config(config)
        head_dim = getattr(config.text_config, "head_dim", None)
        if getattr(config, "head_dim", None) is None and head_dim is not None:
            config.head_dim = head_dim

    @classmethod
    def make_variant(cls, config: Any) -> DecoderVariant:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderVariant(
            qkv_bias=bias, o_bias=bias, qk_norm=True, mlp_bias=False, sliding_windows=sliding_windows(config)
        )

    def vision_info(self) -> VisionInfo:
        """Qwen2.5-VL's, with feature rows that carry their DeepStack rows beside them."""
        info = super().vision_info()
        info.feature_width = self.config.hidden_size * (1 + self.deepstack)
        return info

    def forward_rows(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: list[Tensor],
        attn_metadata: AttentionMetadata,
        rows: Tensor,
        embeds: Tensor,
    ) -> Tensor:
        """`DecoderForCausalLM.forward_rows` for image rows that carry their DeepStack sets
        (`encode_grid`): the first set replaces the rows' embeddings, each other is added at
        `rows` after its layer."""
        x = self.embed(input_ids)
        width = x.shape[-1]
        features = embeds.to(x.dtype)
        x[rows] = features[:, :width]
        deep = features[:, width:].split(width, dim=-1) if features.shape[1] > width else ()
        with step_metadata(attn_metadata):
            cos, sin = self.rotary.cos_sin(positions, x.dtype)
            residual = None
            for i, (layer, kv_cache) in enumerate(zip(self.own_layers, kv_caches, strict=True)):
                x, residual = layer(x, residual, cos, sin, kv_cache)
                if i < len(deep):  # `x` is the layer's output before its residual add: adding here adds to the sum
                    x = x.index_add(0, rows, deep[i])
            return self.model.norm(x, residual)[0]

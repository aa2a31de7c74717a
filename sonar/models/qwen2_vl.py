"""Qwen2.5-VL and Qwen2-VL: a vision transformer with a patch merger, and Qwen2's decoder with M-RoPE.

**Vision tower.** The image processor (`sonar.multimodal.qwen2_vl`) resizes an image to a multiple
of ``patch_size * merge_size`` (dynamic resolution), repeats it ``temporal_patch_size`` times over
time and cuts it into patches: ``pixels`` ``[t * h * w, 3 * temporal_patch_size * patch_size ** 2]``
with the grid ``(t, h, w)`` in patches, each ``merge_size x merge_size`` block of patches
consecutive. A Conv3d embeds each patch; the blocks rotate their queries and keys by the patch's
(row, column) (a 2D rotary: half the frequencies turn with the row, half with the column) and
attend within windows of ``window_size`` pixels, except the `fullatt_block_indexes` blocks, which
attend over the whole frame; the tokens are reordered window by window for that and put back in
order at the end. The merger (RMSNorm, then an MLP over each block's ``merge_size ** 2`` patches
side by side) gives one row per block: ``t * h * w / merge_size ** 2`` rows, one per
``<|image_pad|>`` token of the prompt. Qwen2-VL's tower is the same but for its layers: LayerNorms
instead of RMSNorms, a plain two-layer MLP (``mlp_ratio``, quick GELU) instead of a gated one,
and full attention in every block (no windows); its config names the tower's width ``embed_dim``
and the output ``hidden_size``.

**M-RoPE.** The decoder rotates by three positions per token (temporal, height, width), each
turning its own section of the frequencies (``rope_scaling.mrope_section``). Text tokens take the
same value in all three, which is ordinary RoPE at that position; an image's tokens take
``(start, start + row, start + column)`` over its merged grid, and the text after it continues
from ``start + max(rows, columns)``. So a prompt's positions are a table `rope_index` computes
from its images' places and grids, and every token after the prompt sits at its ordinary position
plus the request's delta (the table's last position + 1 minus the prompt's length). The runner
keeps the table per request; `forward` takes positions ``[3, num_tokens]`` (a step that embeds
image rows) or ``[num_tokens]`` (any other step: text rows, whose three positions agree).

Checkpoint names: ``visual.*``, ``model.*`` (the decoder), ``lm_head.*``; transformers' in-memory
names ``model.visual.*`` and ``model.language_model.*`` map onto them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sonar.models.decoder import (
    EAGLE,
    LORA,
    PIPELINE_PARALLEL,
    QUANTIZED,
    TENSOR_PARALLEL,
    DecoderForCausalLM,
    DecoderVariant,
    sliding_windows,
)
from sonar.models.errors import ModelLoadError
from sonar.models.llava import ACTIVATIONS, TEXT_FIELDS
from sonar.models.parallel import SINGLE, WHOLE, PipelineStage, TensorParallel
from sonar.protocol.engine import ImageInput, VisionInfo

_NOT_YET = "not implemented for Qwen2-VL / Qwen2.5-VL yet"

#: What a chat's image part becomes in the text the template renders (Qwen2.5-VL's template
#: renders an image part so); the processor expands the pad token to the image's rows.
IMAGE_TEXT = "<|vision_start|><|image_pad|><|vision_end|>"


def rope_index(prompt_len: int, images: Sequence[ImageInput], merge: int) -> tuple[Tensor, int]:
    """The prompt's M-RoPE positions ``[3, prompt_len]`` (int64) and the delta of every later
    position (transformers' ``get_rope_index`` for images: see the module docstring)."""
    table = torch.empty(3, prompt_len, dtype=torch.int64)
    pos = done = 0
    for image in images:
        text = image.offset - done
        table[:, done : image.offset] = torch.arange(pos, pos + text)
        pos += text
        t, h, w = image.grid
        h, w = h // merge, w // merge
        table[0, image.offset : image.offset + image.length] = pos
        table[1, image.offset : image.offset + image.length] = (torch.arange(h) + pos).repeat_interleave(w).repeat(t)
        table[2, image.offset : image.offset + image.length] = (torch.arange(w) + pos).repeat(t * h)
        pos += max(h, w)
        done = image.offset + image.length
    table[:, done:] = torch.arange(pos, pos + prompt_len - done)
    last = int(table.max()) if prompt_len else -1
    return table, last + 1 - prompt_len


def window_index(grid: Sequence[int], merge: int, window: int) -> tuple[Tensor, list[int]]:
    """The order of the merged blocks window by window (`window` blocks a side, row-major windows,
    row-major blocks within each), and each window's length in patches."""
    t, h, w = grid
    bh, bw = h // merge, w // merge
    blocks = torch.arange(t * bh * bw).view(t, bh, bw)
    order: list[Tensor] = []
    lengths: list[int] = []
    for frame in blocks:
        for top in range(0, bh, window):
            for left in range(0, bw, window):
                part = frame[top : top + window, left : left + window].reshape(-1)
                order.append(part)
                lengths.append(part.numel() * merge * merge)
    return torch.cat(order), lengths


def patch_positions(grid: Sequence[int], merge: int) -> Tensor:
    """Each patch's (row, column) ``[t * h * w, 2]``, patches in the processor's order (each
    ``merge x merge`` block consecutive)."""
    t, h, w = grid
    rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
    cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
    rows, cols = rows.transpose(1, 2).reshape(-1), cols.transpose(1, 2).reshape(-1)
    return torch.stack((rows, cols), dim=-1).repeat(t, 1)


@dataclass(frozen=True)
class VisionSpec:
    """The tower's shape, from either family's vision config."""

    hidden: int
    heads: int
    depth: int
    intermediate: int
    act: str
    out: int
    gated: bool
    """Qwen2.5-VL: RMSNorms and a gated MLP; Qwen2-VL: LayerNorms and fc1/fc2."""
    window: int | None
    """A window's side in merged blocks (None: every block attends over the whole frame)."""
    full_blocks: frozenset[int]

    @classmethod
    def qwen2_5(cls, config: Any) -> VisionSpec:
        return cls(
            config.hidden_size,
            config.num_heads,
            config.depth,
            config.intermediate_size,
            config.hidden_act,
            config.out_hidden_size,
            True,
            config.window_size // config.spatial_merge_size // config.patch_size,
            frozenset(config.fullatt_block_indexes),
        )

    @classmethod
    def qwen2(cls, config: Any) -> VisionSpec:
        width = config.embed_dim
        return cls(
            width,
            config.num_heads,
            config.depth,
            int(width * config.mlp_ratio),
            config.hidden_act,
            config.hidden_size,
            False,
            None,
            frozenset(range(config.depth)),
        )


class VisionRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        f = x.float()
        return self.weight * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, lengths: list[int]) -> Tensor:
        n, d = x.shape
        qkv = self.qkv(x).view(n, 3, self.heads, d // self.heads)
        q, k = _rotate(qkv[:, :2], cos, sin).unbind(1)
        return self.proj(window_attention(q, k, qkv[:, 2], lengths).view(n, d))


def window_attention(q: Tensor, k: Tensor, v: Tensor, lengths: list[int]) -> Tensor:
    """Attention of ``q, k, v`` ``[n, heads, head_dim]`` within consecutive windows of `lengths`
    rows (their sum is ``n``). Windows of one length run as one batched call (``[windows, heads,
    length, head_dim]``), so a frame's windows cost one kernel, not one Python iteration each (on
    CPU that also keeps the call 4D, which PyTorch's flash kernel needs: a 3D call falls back to
    the unfused math path, several times slower); a frame cut into windows has at most four
    lengths (inner, right edge, bottom edge, corner)."""
    n, heads, dim = q.shape

    def attend(rows: Tensor | None, length: int) -> Tensor:
        parts = (t if rows is None else t[rows] for t in (q, k, v))
        batched = [t.view(-1, length, heads, dim).transpose(1, 2) for t in parts]
        return F.scaled_dot_product_attention(*batched).transpose(1, 2).reshape(-1, heads, dim)

    if len(set(lengths)) == 1:
        return attend(None, lengths[0])
    starts: dict[int, list[int]] = {}
    start = 0
    for length in lengths:
        starts.setdefault(length, []).append(start)
        start += length
    out = torch.empty_like(q)
    for length, firsts in starts.items():
        rows = (torch.tensor(firsts, device=q.device)[:, None] + torch.arange(length, device=q.device)).view(-1)
        out[rows] = attend(rows, length)
    return out


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The vision rotary of ``x`` ``[n, ..., head_dim]`` by ``cos, sin`` ``[n, head_dim]``, in
    float32 as transformers applies it."""
    f = x.float()
    half = f.shape[-1] // 2
    shape = (cos.shape[0],) + (1,) * (f.dim() - 2) + (cos.shape[-1],)
    rotated = torch.cat((-f[..., half:], f[..., :half]), dim=-1)
    return (f * cos.view(shape) + rotated * sin.view(shape)).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ModelLoadError(f"vision hidden_act {act!r} is not supported (one of {', '.join(ACTIVATIONS)})")
        self.act = ACTIVATIONS[act]
        self.gate_proj = nn.Linear(hidden, intermediate)
        self.up_proj = nn.Linear(hidden, intermediate)
        self.down_proj = nn.Linear(intermediate, hidden)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PlainMLP(nn.Module):
    """Qwen2-VL's vision MLP."""

    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ModelLoadError(f"vision hidden_act {act!r} is not supported (one of {', '.join(ACTIVATIONS)})")
        self.act = ACTIVATIONS[act]
        self.fc1 = nn.Linear(hidden, intermediate)
        self.fc2 = nn.Linear(intermediate, hidden)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


def _norm(spec: VisionSpec, size: int) -> nn.Module:
    return VisionRMSNorm(size) if spec.gated else nn.LayerNorm(size, eps=1e-6)


class VisionBlock(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.norm1 = _norm(spec, spec.hidden)
        self.attn = VisionAttention(spec.hidden, spec.heads)
        self.norm2 = _norm(spec, spec.hidden)
        mlp = VisionMLP if spec.gated else PlainMLP
        self.mlp = mlp(spec.hidden, spec.intermediate, spec.act)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, lengths: list[int]) -> Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, config: Any, hidden: int, bias: bool = False) -> None:
        super().__init__()
        self.shape = (config.in_channels, config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, hidden, self.shape[1:], self.shape[1:], bias=bias)

    def forward(self, pixels: Tensor) -> Tensor:
        x = pixels.to(self.proj.weight.dtype).view(-1, *self.shape)
        return self.proj(x).view(x.shape[0], -1)


class PatchMerger(nn.Module):
    def __init__(self, spec: VisionSpec, merge: int) -> None:
        super().__init__()
        hidden, out = spec.hidden, spec.out
        self.width = hidden * merge * merge
        self.ln_q = _norm(spec, hidden)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, out))

    def forward(self, x: Tensor) -> Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class VisionTransformer(nn.Module):
    """The vision tower and merger (see the module docstring); `spec` None: Qwen2.5-VL's from `config`."""

    def __init__(self, config: Any, spec: VisionSpec | None = None) -> None:
        super().__init__()
        spec = VisionSpec.qwen2_5(config) if spec is None else spec
        self.merge = config.spatial_merge_size
        self.patch_size = config.patch_size
        self.window = spec.window
        self.full_blocks = spec.full_blocks
        head_dim = spec.hidden // spec.heads
        theta = float((getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        axis = head_dim // 2  # each axis (row, column) turns half of a head's dimensions
        with torch.device("cpu"):
            self.inv_freq = 1.0 / theta ** (torch.arange(0, axis, 2, dtype=torch.float32) / axis)
        self.patch_embed = PatchEmbed(config, spec.hidden)
        self.blocks = nn.ModuleList(VisionBlock(spec) for _ in range(spec.depth))
        self.merger = PatchMerger(spec, self.merge)

    def forward(self, pixels: Tensor, grid: Sequence[int]) -> Tensor:
        """One image's patches ``[t * h * w, patch values]`` to its rows ``[t * h * w / merge ** 2, out]``."""
        unit = self.merge * self.merge
        t, h, w = grid
        frames = [h * w] * t
        if self.window is None:
            order, window_lengths = torch.arange(t * h * w // unit), frames
        else:
            order, window_lengths = window_index(grid, self.merge, self.window)
        order = order.to(pixels.device)
        x = self.patch_embed(pixels)
        n = x.shape[0]
        x = x.view(n // unit, unit, -1)[order].view(n, -1)
        angles = patch_positions(grid, self.merge).to(pixels.device)[..., None].float() * self.inv_freq.to(x.device)
        angles = angles.flatten(1).view(n // unit, unit, -1)[order].view(n, -1)
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames if i in self.full_blocks else window_lengths)
        return self.merger(x)[torch.argsort(order)]


class Qwen2_5_VLForConditionalGeneration(DecoderForCausalLM):
    """Qwen2.5-VL: the vision transformer, then Qwen2's decoder with M-RoPE (this class's base)."""

    architectures = ("Qwen2_5_VLForConditionalGeneration",)
    refused: ClassVar[dict[str, str]] = {
        TENSOR_PARALLEL: _NOT_YET,
        PIPELINE_PARALLEL: _NOT_YET,
        LORA: _NOT_YET,
        QUANTIZED: _NOT_YET,
        EAGLE: _NOT_YET,
    }

    tower_modules: ClassVar[tuple[str, ...]] = ("visual",)
    """What only pictures need (`sonar.models.loader.drop_tower`)."""

    def __init__(self, config: Any, parallel: TensorParallel = SINGLE, stage: PipelineStage = WHOLE) -> None:
        text, vision = config.text_config, config.vision_config
        super().__init__(text, parallel, stage)
        section = self.rotary.mrope_section
        if section is None or sum(section) != self.head_dim // 2:
            raise ModelLoadError(
                f"rope mrope_section {section} must split the {self.head_dim // 2} rotary frequencies in three"
            )
        self.image_token_id = int(config.image_token_id)
        self.merge = int(vision.spatial_merge_size)
        self.patch_size = int(vision.patch_size)
        self.temporal_patch_size = int(vision.temporal_patch_size)
        self.visual = self.make_tower(vision)

    @staticmethod
    def make_tower(vision: Any) -> nn.Module:
        return VisionTransformer(vision, VisionSpec.qwen2_5(vision))

    @classmethod
    def prepare_config(cls, config: Any) -> None:
        """Copy the text model's fields the loader and runner read to the config's top level."""
        text = config.text_config
        for name in TEXT_FIELDS:
            if getattr(config, name, None) is None and getattr(text, name, None) is not None:
                setattr(config, name, getattr(text, name))
        text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))

    @classmethod
    def make_variant(cls, config: Any) -> DecoderVariant:
        return DecoderVariant(
            qkv_bias=True, o_bias=False, qk_norm=False, mlp_bias=False, sliding_windows=sliding_windows(config)
        )

    def vision_info(self) -> VisionInfo:
        """What the frontend needs: images of any size, cut into patches by the Qwen2-VL processor."""
        return VisionInfo(
            self.image_token_id,
            0,
            0,
            image_text=IMAGE_TEXT,
            patch_size=self.patch_size,
            merge_size=self.merge,
            temporal_patch_size=self.temporal_patch_size,
        )

    def rope_index(self, prompt_len: int, images: Sequence[ImageInput]) -> tuple[Tensor, int]:
        """The prompt's M-RoPE positions and the delta after it (`rope_index`)."""
        return rope_index(prompt_len, images, self.merge)

    def encode_grid(self, pixels: Tensor, grid: Sequence[int]) -> Tensor:
        """One image's feature rows ``[t * h * w / merge ** 2, hidden]`` (in the decoder's dtype),
        the tower run in its own dtype (float32 on CPU for a bfloat16 model: `sonar.models.loader.tower_in_float32`)."""
        return self.visual(pixels, grid).to(self.model.embed_tokens.weight.dtype)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """The decoder's tensors as `DecoderForCausalLM` loads them; the tower's as they are."""
        params = dict(self.named_parameters())
        done: set[str] = set()

        def decoder_weights() -> Iterator[tuple[str, Tensor]]:
            for name, tensor in _renamed(weights):
                if not name.startswith("visual."):
                    yield name, tensor
                    continue
                target = params.get(name)
                if target is None:
                    continue
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ModelLoadError(
                        f"weight {name} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}"
                    )
                target.data.copy_(tensor)
                done.add(name)

        return super().load_weights(decoder_weights()) | done


class Qwen2VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    """Qwen2-VL: Qwen2.5-VL's design with the earlier tower (see the module docstring)."""

    architectures = ("Qwen2VLForConditionalGeneration",)

    @staticmethod
    def make_tower(vision: Any) -> VisionTransformer:
        return VisionTransformer(vision, VisionSpec.qwen2(vision))


def _renamed(weights: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    for name, tensor in weights:
        if name.startswith("model.visual."):
            name = name.removeprefix("model.")
        elif name.startswith("model.language_model."):
            name = "model." + name.removeprefix("model.language_model.")
        yield name, tensor

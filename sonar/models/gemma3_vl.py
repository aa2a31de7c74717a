"""Gemma 3 with images: a SigLIP vision tower, Gemma 3's projector and the Gemma 3 text decoder.

**Tower.** SigLIP's vision transformer: square patches (14 px in the released checkpoints; a Conv2d with a bias) plus a learned
position per patch (no class token), pre-LayerNorm layers as CLIP's (`sonar.models.llava`'s),
then the post-LayerNorm. The image processor resizes every picture to the tower's square
(`sonar.multimodal.gemma3`), so an image always gives ``(image_size / patch_size) ** 2`` patches.

**Projector.** The patches' grid is average-pooled to ``mm_tokens_per_image`` rows (896 px, 64x64
patches, 4x4 pools: 256 rows), each normed with Gemma's RMSNorm (``mm_soft_emb_norm``) and
multiplied by ``mm_input_projection_weight`` into the text model's hidden size. The rows replace
the embeddings of the prompt's image tokens (``<image_soft_token>``) unscaled (the text tokens' embeddings are
scaled by ``sqrt(hidden_size)``, as in Gemma 3 text).

**Attention among an image's tokens.** transformers lets every token of a run of image tokens
attend to every other of the same run in prefill (``token_type_ids``: full layers causal OR same
run; sliding layers additionally within the window behind the query). Sonar does the same: a step
that embeds image rows (`forward_rows`) finds each sequence's runs of image tokens among its query
rows (`ImageBlocks`), and its attention (`ImageBlocks.attend`) recomputes those sequences' rows
with that mask over the paged cache. That is exact only when a run's tokens are all in the step
or before it: the scheduler never ends a prefill chunk inside an image (`VisionInfo.bidirectional`,
`sonar.core.schedule`); a prefix-cache hit may end inside one, its blocks hold the keys and values
a whole-image step computed. Decode steps never see image tokens as queries: their attention is
the plain causal one.

Checkpoint names: ``language_model.model.*`` / ``model.language_model.*``, ``vision_tower.*``
(``vision_tower.vision_model.*`` in older files) and ``multi_modal_projector.*``, as LLaVA's; the
SigLIP pooling head (``vision_use_head``) is refused, transformers' Gemma 3 never builds it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sonar.kernels.attention import AttentionMetadata, scores_attention
from sonar.kernels.attention_op import attention, current_metadata, step_metadata
from sonar.models.decoder import EAGLE, LORA, PIPELINE_PARALLEL, QUANTIZED, TENSOR_PARALLEL
from sonar.models.errors import ModelLoadError
from sonar.models.gemma import Gemma3ForCausalLM, GemmaRMSNorm
from sonar.models.llava import TEXT_FIELDS, VisionEncoder, _renamed
from sonar.models.parallel import SINGLE, WHOLE, PipelineStage, TensorParallel
from sonar.protocol.engine import VisionInfo

#: An image part of a chat message in the text the chat template renders: what transformers'
#: `Gemma3Processor` puts where the template wrote ``<start_of_image>``, with one image token
#: (`sonar.multimodal.processor.expand_images` repeats it ``mm_tokens_per_image`` times).
IMAGE_TEXT = "\n\n<start_of_image><image_soft_token><end_of_image>\n\n"

_NOT_YET = "not implemented for Gemma 3 with images yet"


class SiglipEmbeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_positions = (config.image_size // config.patch_size) ** 2
        self.patch_embedding = nn.Conv2d(config.num_channels, hidden, config.patch_size, config.patch_size)
        self.position_embedding = nn.Embedding(
            self.num_positions, hidden, _weight=torch.empty(self.num_positions, hidden)
        )

    def forward(self, pixels: Tensor) -> Tensor:
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        return patches + self.position_embedding.weight


class SiglipVisionTower(nn.Module):
    """SigLIP's vision transformer up to its post-LayerNorm (the last hidden state Gemma 3 reads)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.embeddings = SiglipEmbeddings(config)
        self.encoder = VisionEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixels: Tensor) -> Tensor:
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class Gemma3Projector(nn.Module):
    """Average-pool the patch grid to the image's rows, norm them, project to the text model."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        vision, text = config.vision_config, config.text_config
        self.patches_per_side = vision.image_size // vision.patch_size
        self.tokens_per_side = int(round(config.mm_tokens_per_image**0.5))
        if self.tokens_per_side**2 != config.mm_tokens_per_image or self.patches_per_side % self.tokens_per_side:
            raise ModelLoadError(
                f"mm_tokens_per_image {config.mm_tokens_per_image} is not a square whose side divides the "
                f"tower's {self.patches_per_side} patches a side"
            )
        self.kernel = self.patches_per_side // self.tokens_per_side
        self.mm_input_projection_weight = nn.Parameter(torch.empty(vision.hidden_size, text.hidden_size))
        self.mm_soft_emb_norm = GemmaRMSNorm(vision.hidden_size, vision.layer_norm_eps)

    def forward(self, states: Tensor) -> Tensor:
        n, _, hidden = states.shape
        side = self.patches_per_side
        grid = states.transpose(1, 2).reshape(n, hidden, side, side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight)


@dataclass(frozen=True)
class ImageBlocks:
    """One step's runs of image tokens, which attend to each other (see the module docstring):
    per sequence of the step (its index in the step's metadata), the runs as ``(first, end)``
    query rows counted from the sequence's first query row."""

    runs: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]

    @classmethod
    def of_step(cls, input_ids: Tensor, meta: AttentionMetadata, image_token_id: int) -> ImageBlocks | None:
        """The runs of two or more image tokens among each sequence's query rows; None without any."""
        is_image = (input_ids == image_token_id).tolist()
        starts = meta.query_start_loc.tolist()
        found = []
        for seq in range(len(starts) - 1):
            runs, first = [], None
            rows = is_image[starts[seq] : starts[seq + 1]]
            for i, image in enumerate([*rows, False]):
                if image and first is None:
                    first = i
                elif not image and first is not None:
                    if i - first > 1:
                        runs.append((first, i))
                    first = None
            if runs:
                found.append((seq, tuple(runs)))
        return cls(tuple(found)) if found else None

    def attend(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        kv_cache: Tensor,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> Tensor:
        """`sonar.kernels.attention_op.attention` (which writes the cache and attends causally),
        then the rows of the sequences with runs again with each run's tokens seeing each other."""
        out = attention(query, key, value, kv_cache, scale, sliding_window, softcap)
        meta = current_metadata()
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        num_heads = query.shape[1]
        group = num_heads // num_kv_heads
        fp8 = kv_cache.dtype == torch.float8_e4m3fn  # written with unit scales (Gemma passes none)
        flat = kv_cache.view(torch.uint8 if fp8 else kv_cache.dtype).view(2, -1, num_kv_heads, head_dim)
        plan = meta.reference_plan(block_size)
        for seq, runs in self.runs:
            start, q_len, seq_len = plan.query_starts[seq], plan.query_lens[seq], plan.seq_lens[seq]
            slots = plan.prefill_slots(seq)
            k, v = (flat[i].index_select(0, slots) for i in (0, 1))
            if fp8:
                k, v = (t.view(torch.float8_e4m3fn).to(query.dtype) for t in (k, v))
            mask = _image_mask(q_len, seq_len, runs, sliding_window, query.device)
            q = (
                query[start : start + q_len]
                .to(k.dtype)
                .view(q_len, num_kv_heads, group, head_dim)
                .permute(1, 2, 0, 3)
                .reshape(1, num_kv_heads, group * q_len, head_dim)
            )
            k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
            mask = mask.repeat(group, 1)
            if softcap is None:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
            else:
                o = scores_attention(q, k, v, mask, scale, softcap)
            out[start : start + q_len] = (
                o.view(num_kv_heads, group, q_len, head_dim)
                .permute(2, 0, 1, 3)
                .reshape(q_len, num_heads, head_dim)
                .to(out.dtype)
            )
        return out


def _image_mask(
    q_len: int, seq_len: int, runs: Iterable[tuple[int, int]], sliding_window: int | None, device: torch.device
) -> Tensor:
    """``[q_len, seq_len]`` bool: the last ``q_len`` positions attending causally, each run's
    tokens also to the run's later tokens; a sliding window keeps only keys less than the window
    behind the query (transformers' ``AND(sliding_window, OR(causal, blockwise))``)."""
    offset = seq_len - q_len
    q_pos = torch.arange(offset, seq_len, device=device)[:, None]
    k_pos = torch.arange(seq_len, device=device)[None, :]
    mask = k_pos <= q_pos
    for first, end in runs:
        mask[first:end, offset + first : offset + end] = True
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """Gemma 3 with images: SigLIP tower, pooling projector, Gemma 3 decoder (this class's base)."""

    architectures = ("Gemma3ForConditionalGeneration",)
    refused: ClassVar[dict[str, str]] = {
        TENSOR_PARALLEL: _NOT_YET,
        PIPELINE_PARALLEL: _NOT_YET,
        LORA: _NOT_YET,
        QUANTIZED: _NOT_YET,
        EAGLE: _NOT_YET,
    }
    tower_modules: ClassVar[tuple[str, ...]] = ("vision_tower", "multi_modal_projector")
    """What only pictures need (`sonar.models.loader.drop_tower`)."""

    def __init__(self, config: Any, parallel: TensorParallel = SINGLE, stage: PipelineStage = WHOLE) -> None:
        text, vision = config.text_config, config.vision_config
        if getattr(vision, "model_type", "siglip_vision_model") != "siglip_vision_model":
            raise ModelLoadError(f"Gemma 3 with a {vision.model_type!r} vision tower is not supported (SigLIP)")
        if getattr(vision, "vision_use_head", False):
            raise ModelLoadError(
                "Gemma 3's SigLIP vision_use_head (a pooling head Gemma 3 never reads) is not supported"
            )
        super().__init__(text, parallel, stage)
        token = getattr(config, "image_token_id", None)
        self.image_token_id = int(config.image_token_index if token is None else token)
        if not 0 <= self.image_token_id < text.vocab_size:
            raise ModelLoadError(
                f"Gemma 3 image token {self.image_token_id} is outside the {text.vocab_size} embeddings"
            )
        self.tokens_per_image = int(config.mm_tokens_per_image)
        self.image_size = int(vision.image_size)
        self.vision_tower = SiglipVisionTower(vision)
        self.multi_modal_projector = Gemma3Projector(config)

    @classmethod
    def prepare_config(cls, config: Any) -> None:
        """Copy the text model's fields the loader and runner read to the config's top level."""
        text = config.text_config
        for name in (*TEXT_FIELDS, "head_dim"):
            if getattr(config, name, None) is None and getattr(text, name, None) is not None:
                setattr(config, name, getattr(text, name))

    def vision_info(self) -> VisionInfo:
        """Images of one square size, resized without a crop; an image's tokens see each other."""
        return VisionInfo(
            self.image_token_id,
            self.tokens_per_image,
            self.image_size,
            image_text=IMAGE_TEXT,
            processor="gemma3",
            bidirectional=True,
        )

    def encode_images(self, pixel_values: Tensor) -> Tensor:
        """Images ``[n, 3, image_size, image_size]`` to their rows ``[n, mm_tokens_per_image,
        hidden]`` (in the decoder's dtype): transformers' ``get_image_features``."""
        # in their own dtype: float32 on CPU for a bfloat16 model (`sonar.models.loader.tower_in_float32`)
        states = self.vision_tower(pixel_values)
        return self.multi_modal_projector(states).to(self.model.embed_tokens.weight.dtype)

    def forward_rows(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: list[Tensor],
        attn_metadata: AttentionMetadata,
        rows: Tensor,
        embeds: Tensor,
    ) -> Tensor:
        """`DecoderForCausalLM.forward_rows`, with each run of image tokens in the step attending
        to itself (`ImageBlocks`)."""
        x = self.embed(input_ids)
        x[rows] = embeds.to(x.dtype)
        blocks = ImageBlocks.of_step(input_ids, attn_metadata, self.image_token_id)
        attend = None if blocks is None else blocks.attend
        with step_metadata(attn_metadata):
            tables = self.rotary.tables(positions, x.dtype)
            residual = None
            for layer, kv_cache in zip(self.own_layers, kv_caches, strict=True):
                x, residual = layer(x, residual, *tables[layer.kind], kv_cache, attend)
            return self.model.norm(x, residual)[0]

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """The decoder's tensors as `DecoderForCausalLM` loads them; the tower's and the
        projector's as they are."""
        params = dict(self.named_parameters())
        done: set[str] = set()

        def decoder_weights() -> Iterator[tuple[str, Tensor]]:
            for name, tensor in _renamed(weights):
                if not name.startswith(("vision_tower.", "multi_modal_projector.")):
                    yield name, tensor
                    continue
                target = params.get(name)
                if target is None and not hasattr(self, "vision_tower"):  # dropped (`drop_tower`)
                    continue
                if target is None:
                    raise ModelLoadError(f"weight {name} is not one of Gemma 3's vision tower or projector")
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ModelLoadError(
                        f"weight {name} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}"
                    )
                target.data.copy_(tensor)
                done.add(name)

        return super().load_weights(decoder_weights()) | done

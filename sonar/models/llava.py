"""LLaVA (1.5-style): a CLIP vision tower, a two-layer MLP projector and a Llama language model.

An image becomes a fixed number of the language model's input embeddings: the tower turns its
pixels ``[3, image_size, image_size]`` into one hidden state per patch (plus the class token),
taken after layer `vision_feature_layer` (a list of layers: their states side by side); the
``default`` strategy drops the class token, ``full`` keeps it. The projector maps each to the
text model's hidden size. The prompt holds one image token (``image_token_index``) per feature
row, expanded from the chat's single placeholder by `sonar.multimodal.processor`.

The runner's contract beyond `DecoderForCausalLM`'s: `encode_images` gives an image's feature
rows, which the runner gives `DecoderForCausalLM.forward_rows` in place of the image tokens'
embeddings. A step over part of an image's tokens (a chunked prefill, a prefix-cache hit inside
it) passes only that part's rows.

Checkpoint names: transformers writes ``language_model.model.*``, ``language_model.lm_head``,
``vision_tower.*`` and ``multi_modal_projector.*`` (older checkpoints ``vision_tower.vision_model.*``,
newer in-memory names ``model.language_model.*``); all map onto this module's names.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
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
)
from sonar.models.errors import ModelLoadError
from sonar.models.parallel import SINGLE, WHOLE, PipelineStage, TensorParallel

ACTIVATIONS = {
    "gelu": F.gelu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}

#: What the loader, the runner and the LoRA limits read from a config's top level, which a
#: LLaVA config keeps in its `text_config`.
TEXT_FIELDS = (
    "num_hidden_layers",
    "vocab_size",
    "hidden_size",
    "max_position_embeddings",
    "eos_token_id",
    "initializer_range",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
)

_NOT_YET = "not implemented for LLaVA yet"


def _activation(name: str) -> Any:
    fn = ACTIVATIONS.get(name)
    if fn is None:
        raise ModelLoadError(f"activation {name!r} is not supported (one of {', '.join(ACTIVATIONS)})")
    return fn


class VisionEmbeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.patch_size = config.patch_size
        self.num_positions = (config.image_size // config.patch_size) ** 2 + 1
        self.class_embedding = nn.Parameter(torch.empty(hidden))
        self.patch_embedding = nn.Conv2d(config.num_channels, hidden, config.patch_size, config.patch_size, bias=False)
        self.position_embedding = nn.Embedding(
            self.num_positions, hidden, _weight=torch.empty(self.num_positions, hidden)
        )

    def forward(self, pixels: Tensor) -> Tensor:
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(pixels.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class VisionAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.heads = config.num_attention_heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: Tensor) -> Tensor:
        b, n, d = x.shape

        def heads(t: Tensor) -> Tensor:
            return t.view(b, n, self.heads, d // self.heads).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)))
        return self.out_proj(out.transpose(1, 2).reshape(b, n, d))


class VisionMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.act = _activation(config.hidden_act)
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionLayer(nn.Module):
    """A pre-LayerNorm transformer layer (CLIP's)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = VisionAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = VisionMLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(config) for _ in range(config.num_hidden_layers))


class CLIPVisionTower(nn.Module):
    """CLIP's vision transformer up to the hidden states LLaVA reads (its post-LayerNorm is never used)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.embeddings = VisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)  # CLIP's spelling
        self.encoder = VisionEncoder(config)

    def hidden_states(self, pixels: Tensor, layers: list[int]) -> list[Tensor]:
        """The states after each of `layers` layers (0: the embeddings), in the order asked."""
        x = self.pre_layrnorm(self.embeddings(pixels))
        wanted = {n: None for n in layers}
        states: dict[int, Tensor] = {0: x} if 0 in wanted else {}
        for i, layer in enumerate(self.encoder.layers[: max(layers)], start=1):
            x = layer(x)
            if i in wanted:
                states[i] = x
        return [states[n] for n in layers]


class Projector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias)
        self.act = _activation(act)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(DecoderForCausalLM):
    """LLaVA 1.5: CLIP tower, MLP projector, Llama decoder (the decoder is this class's base)."""

    architectures = ("LlavaForConditionalGeneration",)
    own_weights: ClassVar[tuple[str, ...]] = ("vision_tower.", "multi_modal_projector.")
    tower_modules: ClassVar[tuple[str, ...]] = ("vision_tower", "multi_modal_projector")
    """What only pictures need (`sonar.models.loader.drop_tower`)."""
    """Prefixes of the tensors loaded as they are (not the decoder's)."""
    refused: ClassVar[dict[str, str]] = {
        TENSOR_PARALLEL: _NOT_YET,
        PIPELINE_PARALLEL: _NOT_YET,
        LORA: _NOT_YET,
        QUANTIZED: _NOT_YET,
        EAGLE: _NOT_YET,
    }

    def __init__(self, config: Any, parallel: TensorParallel = SINGLE, stage: PipelineStage = WHOLE) -> None:
        text, vision = config.text_config, config.vision_config
        if getattr(text, "model_type", "llama") not in ("llama", "mistral"):
            raise ModelLoadError(f"LLaVA with a {text.model_type!r} language model is not supported (llama, mistral)")
        if getattr(vision, "model_type", "clip_vision_model") != "clip_vision_model":
            raise ModelLoadError(f"LLaVA with a {vision.model_type!r} vision tower is not supported (CLIP)")
        super().__init__(text, parallel, stage)
        strategy = config.vision_feature_select_strategy
        if strategy not in ("default", "full"):
            raise ModelLoadError(f"vision_feature_select_strategy {strategy!r} is not supported (default, full)")
        self.keep_class_token = strategy == "full"
        layers = config.vision_feature_layer
        layers = [layers] if isinstance(layers, int) else list(layers)
        depth = vision.num_hidden_layers
        self.feature_layers = [n if n >= 0 else depth + 1 + n for n in layers]
        """Hidden-state indices (0: the embeddings, ``depth``: the last layer's output)."""
        if not all(0 <= n <= depth for n in self.feature_layers):
            raise ModelLoadError(f"vision_feature_layer {layers} is outside the tower's {depth} layers")
        token = getattr(config, "image_token_id", None)  # transformers' newer name
        self.image_token_id = int(config.image_token_index if token is None else token)
        self.tokens_per_image = (vision.image_size // vision.patch_size) ** 2 + int(self.keep_class_token)
        self.image_size = int(vision.image_size)
        self.vision_tower = CLIPVisionTower(vision)
        self.multi_modal_projector = Projector(
            vision.hidden_size * len(layers),
            text.hidden_size,
            config.projector_hidden_act,
            bool(getattr(config, "multimodal_projector_bias", True)),
        )

    @classmethod
    def prepare_config(cls, config: Any) -> None:
        """Copy the text model's fields the loader and runner read to the config's top level."""
        text = config.text_config
        for name in TEXT_FIELDS:
            if getattr(config, name, None) is None and getattr(text, name, None) is not None:
                setattr(config, name, getattr(text, name))

    def encode_images(self, pixel_values: Tensor) -> Tensor:
        """Images ``[n, 3, image_size, image_size]`` to their feature rows ``[n, tokens_per_image, hidden]``
        (in the decoder's dtype)."""
        dtype = self.model.embed_tokens.weight.dtype
        # in their own dtype: float32 on CPU for a bfloat16 model (`sonar.models.loader.tower_in_float32`)
        states = self.vision_tower.hidden_states(pixel_values, self.feature_layers)
        features = torch.cat(states, dim=-1)
        if not self.keep_class_token:
            features = features[:, 1:]
        return self.multi_modal_projector(features).to(dtype)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """The decoder's tensors as `DecoderForCausalLM` loads them (fusing q/k/v, gate/up); the
        tower's and the projector's as they are (CLIP's post-LayerNorm, never read, is skipped)."""
        params = dict(self.named_parameters())
        done: set[str] = set()

        def decoder_weights() -> Iterator[tuple[str, Tensor]]:
            for name, tensor in _renamed(weights):
                if not name.startswith(self.own_weights):
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


def _renamed(weights: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    for name, tensor in weights:
        name = name.removeprefix("model.") if name.startswith("model.language_model.") else name
        for old, new in (
            ("model.vision_tower.", "vision_tower."),
            ("model.multi_modal_projector.", "multi_modal_projector."),
            ("model.image_newline", "image_newline"),  # LLaVA-NeXT's
            ("vision_tower.vision_model.", "vision_tower."),
            ("language_model.model.", "model."),
            ("language_model.lm_head.", "lm_head."),
            ("language_model.", "model."),
        ):
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        yield name, tensor

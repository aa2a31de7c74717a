"""An EAGLE-3 head: the draft of speculative ``method: eagle3`` (as the EAGLE-3 paper and vLLM's
``llama_eagle3`` define it), for Llama-family targets.

Where EAGLE-1 reads the target's last hidden state, EAGLE-3 reads three of its layers: the
residual stream entering layers ``low, mid, high`` (by default ``2``, ``num_layers // 2`` and
``num_layers - 3``; a checkpoint may name them in ``eagle_aux_hidden_state_layer_ids``),
concatenated in layer order (``3 * hidden``) and fused to ``hidden`` by ``fc``. Its one decoder
layer (``midlayer``) attends over ``[input_layernorm(embed(token p + 1)), hidden_norm(feature p)]``
(``2 * hidden`` into q/k/v) with the raw feature as the residual (the normed one with
``norm_before_residual``), then its MLP; the head's own
``norm`` gives the state its ``lm_head`` reads, over a *draft* vocabulary: draft id ``d`` is target
id ``d + d2t[d]``. A later draft feeds back the layer's output before that norm (``hidden``
wide: ``fc`` fuses the target's layers only).

A checkpoint is a directory with a ``config.json`` (Llama fields, ``draft_vocab_size``) and
safetensors with ``midlayer.*`` (Hugging Face names), ``fc.weight``, ``norm.weight``,
``lm_head.weight``, ``d2t`` and optionally ``t2d`` (a mask over the target's vocabulary, not
needed here) and ``embed_tokens.weight`` (else the target's embeddings are shared).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn

from sonar.kernels.attention import AttentionMetadata
from sonar.kernels.attention_op import step_metadata
from sonar.models.decoder import (
    EAGLE,
    DecoderForCausalLM,
    DecoderLayer,
    RMSNorm,
    fused_name,
    sliding_windows,
    stacked_params,
)
from sonar.models.errors import ModelLoadError
from sonar.models.fused import FusedDecode
from sonar.models.head_vocab import HeadVocab, TargetVocab
from sonar.models.rotary import RotaryEmbedding, rope_parameters
from sonar.models.weights import iter_safetensors, safetensors_files

__all__ = ["AuxCapture", "Eagle3Head", "aux_layer_ids", "head_aux_layer_ids", "load_eagle3_head"]


def aux_layer_ids(config: Any, num_target_layers: int) -> tuple[int, int, int]:
    """The target layers whose input the head reads (0: the embeddings), the config's, else
    low/mid/high."""
    ids = getattr(config, "eagle_aux_hidden_state_layer_ids", None)
    nested = getattr(config, "eagle_config", None)
    if ids is None and isinstance(nested, dict):
        ids = nested.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = (2, num_target_layers // 2, num_target_layers - 3)
    ids = tuple(int(i) for i in ids)
    if len(ids) != 3 or len(set(ids)) != 3 or not all(0 <= i < num_target_layers for i in ids):
        raise ModelLoadError(
            f"EAGLE-3 needs three distinct target layers in 0..{num_target_layers - 1} to read, got {list(ids)} "
            "(set eagle_aux_hidden_state_layer_ids in the head's config.json)"
        )
    return tuple(sorted(ids))  # type: ignore[return-value]


def head_aux_layer_ids(path: str, num_target_layers: int) -> tuple[int, int, int]:
    """`aux_layer_ids` of the head in directory `path` (for a pipeline stage that does not load it)."""
    config = Path(path).expanduser() / "config.json"
    if not config.is_file():
        raise ModelLoadError(f"EAGLE-3 head {path}: no config.json (a local directory is needed)")
    return aux_layer_ids(SimpleNamespace(**json.loads(config.read_text())), num_target_layers)


class AuxCapture:
    """The residual stream entering each chosen target layer during the target's last forward
    pass, caught by forward pre-hooks (the layers must run one by one: the native fused decode
    loop is turned off for this target).

    On a pipeline stage the hooks of the layers other stages hold never fire: a stage sends the
    states of the chosen layers before its end on with its activations (`before`), and the next
    takes them (`receive`), so the last stage has all three."""

    def __init__(self, target: DecoderForCausalLM, layer_ids: tuple[int, ...]) -> None:
        self.layer_ids = layer_ids
        self.states: dict[int, Tensor] = {}
        target.variant = replace(target.variant, native_decode=False)
        target.fused_decode = FusedDecode(target)
        for i in layer_ids:
            target.model.layers[i].register_forward_pre_hook(self._hook(i))

    def _hook(self, layer: int) -> Any:
        def catch(module: nn.Module, args: tuple[Any, ...]) -> None:
            x, residual = args[0], args[1]
            self.states[layer] = x if residual is None else x + residual

        return catch

    def before(self, end: int) -> list[Tensor]:
        """The states of the chosen layers before layer `end`, in layer order."""
        return [self.states[i] for i in self.layer_ids if i < end]

    def receive(self, states: list[Tensor]) -> None:
        """The states of the first ``len(states)`` chosen layers, from an earlier stage."""
        self.states.update(zip(self.layer_ids, states))

    def rows(self, rows: Tensor) -> Tensor:
        """``[len(rows), 3 * hidden]``: the captured states of batch rows `rows`, in layer order."""
        return torch.cat([self.states[i][rows] for i in self.layer_ids], dim=-1)


class Eagle3Layer(nn.Module):
    """The head's decoder layer: a Llama layer whose attention reads ``2 * hidden``."""

    def __init__(self, config: Any, head_dim: int) -> None:
        super().__init__()
        inner = DecoderLayer(config, DecoderForCausalLM.make_variant(config), 0, head_dim)
        attn = inner.self_attn
        attn.qkv_proj = nn.Linear(
            2 * config.hidden_size, attn.q_size + 2 * attn.kv_size, bias=attn.qkv_proj.bias is not None
        )
        self.input_layernorm = inner.input_layernorm
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = attn
        self.post_attention_layernorm = inner.post_attention_layernorm
        self.mlp = inner.mlp
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))
        """The residual is the normed feature, not the feature (a config switch some heads set)."""

    def forward(
        self, embeds: Tensor, features: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor
    ) -> tuple[Tensor, Tensor]:
        normed = self.hidden_norm(features)
        x = torch.cat((self.input_layernorm(embeds), normed), dim=-1)
        h = self.self_attn(x, cos, sin, kv_cache)
        h, residual = self.post_attention_layernorm(h, normed if self.norm_before_residual else features)
        return self.mlp(h), residual


class Eagle3Head(nn.Module):
    def __init__(self, config: Any, target: DecoderForCausalLM, own_embeddings: bool) -> None:
        super().__init__()
        hidden = config.hidden_size
        target_hidden = getattr(config, "target_hidden_size", None) or target.config.hidden_size
        if hidden != target.config.hidden_size or target_hidden != target.config.hidden_size:
            raise ModelLoadError(
                f"the EAGLE-3 head's hidden size {hidden} is not the target's {target.config.hidden_size}"
            )
        self.config = config
        self.head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        self.midlayer = Eagle3Layer(config, self.head_dim)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.draft_vocab_size = int(getattr(config, "draft_vocab_size", None) or config.vocab_size)
        self.lm_head = nn.Linear(hidden, self.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        """Draft id ``d`` is target id ``d + d2t[d]``."""
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden) if own_embeddings else None
        self.target = [target]  # in a list: not a submodule (its weights stay the target's)
        self.vocab: HeadVocab = TargetVocab(target)
        """The target's embeddings, or a copy of them (`sonar.models.head_vocab`)."""
        self.rotary = RotaryEmbedding(
            rope_parameters(config), self.head_dim, getattr(config, "max_position_embeddings", 0)
        )
        self.num_layers = 1
        self.num_kv_heads = self.midlayer.self_attn.num_kv_heads
        self.aux = AuxCapture(target, aux_layer_ids(config, target.config.num_hidden_layers))

    def target_features(self, hidden: Tensor, rows: Tensor) -> Tensor:
        """The head's input features at batch rows `rows` of the target's last step (`hidden`,
        its final states, is not what EAGLE-3 reads)."""
        return self.fc(self.aux.rows(rows))

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        features: Tensor,
        kv_caches: list[Tensor],
        attn_metadata: AttentionMetadata,
    ) -> tuple[Tensor, Tensor]:
        """(normed states for the logits, states to feed back) ``[n, hidden]`` for tokens
        `input_ids` at `positions`, each beside the feature of the position before its token."""
        with step_metadata(attn_metadata):
            embed = self.embed_tokens or self.vocab.embed_tokens
            cos, sin = self.rotary.cos_sin(positions, features.dtype)
            [kv_cache] = kv_caches
            h, residual = self.midlayer(embed(input_ids).to(features.dtype), features, cos, sin, kv_cache)
            return self.norm(h, residual)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """Float32 logits over the draft vocabulary."""
        return self.lm_head(hidden).float()

    def greedy(self, hidden: Tensor) -> Tensor:
        """The target ids of the draft vocabulary's argmax."""
        best = self.compute_logits(hidden).argmax(dim=-1)
        return best + self.d2t[best]


def load_eagle3_head(path: str, target: DecoderForCausalLM, dtype: torch.dtype, device: torch.device) -> Eagle3Head:
    """The head in directory `path` for `target` (ModelLoadError naming what does not fit)."""
    target.require_support(EAGLE)
    if not hasattr(target, "own_layers") or not all(isinstance(x, DecoderLayer) for x in target.own_layers):
        raise ModelLoadError(
            f"EAGLE-3 reads the hidden states of a Llama-family target's layers; {type(target).__name__} "
            "does not expose them"
        )
    root = Path(path).expanduser()
    if not (root / "config.json").is_file():
        raise ModelLoadError(f"EAGLE-3 head {path}: no config.json (a local directory is needed)")
    if not list(root.glob("*.safetensors")) and list(root.glob("*.bin")):
        raise ModelLoadError(
            f"EAGLE-3 head {path}: only pickled .bin weights, which Sonar does not load (unpickling runs code); "
            "convert them to safetensors"
        )
    raw = json.loads((root / "config.json").read_text())
    if "speculators_config" in raw or "hidden_size" not in raw:
        raise ModelLoadError(
            f"EAGLE-3 head {path}: config.json is not a flat Llama config (LlamaForCausalLMEagle3: hidden_size, "
            "num_attention_heads, draft_vocab_size ...); the speculators format is not read"
        )
    raw.setdefault("vocab_size", target.config.vocab_size)
    raw.setdefault("rms_norm_eps", getattr(target.config, "rms_norm_eps", 1e-6))
    raw.setdefault("max_position_embeddings", getattr(target.config, "max_position_embeddings", 0))
    raw.setdefault("num_key_value_heads", raw.get("num_attention_heads"))
    raw.setdefault("num_hidden_layers", 1)
    config = SimpleNamespace(**raw)
    if config.num_hidden_layers != 1:
        raise ModelLoadError(f"EAGLE-3 head {path}: num_hidden_layers {config.num_hidden_layers} (Sonar runs one)")
    if any(sliding_windows(config)):
        raise ModelLoadError(f"EAGLE-3 head {path}: sliding-window attention is not supported")
    if int(config.vocab_size) != target.vocab_size:
        raise ModelLoadError(
            f"EAGLE-3 head {path}: vocabulary of {config.vocab_size} tokens, the target has {target.vocab_size}"
        )
    tensors = {
        name.removeprefix("model.").replace("layers.0.", "midlayer.", 1): tensor
        for name, tensor in iter_safetensors(safetensors_files(root))
        if name != "t2d"
    }
    head = Eagle3Head(config, target, "embed_tokens.weight" in tensors)
    if "d2t" not in tensors and head.draft_vocab_size != target.vocab_size:
        raise ModelLoadError(f"EAGLE-3 head {path}: a draft vocabulary of {head.draft_vocab_size} tokens needs d2t")
    params = {**dict(head.named_parameters()), "d2t": head.d2t}
    stacked = stacked_params(head.midlayer)  # type: ignore[arg-type]
    rows_written = dict.fromkeys(params, 0)
    rows_written["d2t"] = head.draft_vocab_size if "d2t" not in tensors else 0
    for name, tensor in tensors.items():
        target_name, first, rows = fused_name(name, stacked)
        param = params.get(target_name)
        if param is None:
            raise ModelLoadError(f"EAGLE-3 head {path}: unexpected weight {name}")
        dest = param.data if rows is None else param.data.narrow(0, first, rows)
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ModelLoadError(
                f"EAGLE-3 head {path}: {name} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
            )
        dest.copy_(tensor)
        rows_written[target_name] += dest.shape[0]
    missing = [name for name, rows in rows_written.items() if rows != params[name].shape[0]]
    if missing:
        raise ModelLoadError(f"EAGLE-3 head {path}: missing weights {sorted(missing)[:4]}")
    ids = head.d2t + torch.arange(head.draft_vocab_size)
    if int(ids.min()) < 0 or int(ids.max()) >= target.vocab_size:
        raise ModelLoadError(f"EAGLE-3 head {path}: d2t maps draft ids outside the target's vocabulary")
    return head.to(device=device, dtype=dtype)

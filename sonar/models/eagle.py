"""An EAGLE head (EAGLE-1, for Llama-family targets): the draft of speculative ``method: eagle``.

The head predicts the target's next token from the target's own last hidden state: at position
``p`` it takes the embedding of token ``p + 1`` and the target's final (normed) hidden state at
``p``, fuses them (``fc``: ``[2 * hidden] -> [hidden]``), runs them through its decoder layer(s)
(Llama layers; the first has no input norm, the fused vector goes straight into attention) and
returns ``hidden + residual``; the target's LM head turns that into logits. The next draft feeds
the head's own output back in place of the target's hidden state. It has its own KV cache over
the target's block tables (`sonar.engine.drafter`).

A checkpoint is a directory with a ``config.json`` (Llama fields: hidden size, heads, layers,
intermediate size, rope) and safetensors with ``fc.weight`` (``fc.bias`` if it has one),
``layers.N.*`` (Hugging Face names, optionally under ``model.``) and optionally its own
``embed_tokens.weight`` (else the target's embeddings are shared). Pickled ``.bin`` checkpoints
are refused (loading them runs code).
"""

from __future__ import annotations

import json
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
    fused_name,
    sliding_windows,
    stacked_params,
)
from sonar.models.errors import ModelLoadError
from sonar.models.head_vocab import HeadVocab, TargetVocab
from sonar.models.rotary import RotaryEmbedding, rope_parameters
from sonar.models.weights import iter_safetensors, safetensors_files

__all__ = ["EagleHead", "load_eagle_head"]


class EagleHead(nn.Module):
    def __init__(self, config: Any, target: DecoderForCausalLM, fc_bias: bool, own_embeddings: bool) -> None:
        super().__init__()
        if config.hidden_size != target.config.hidden_size:
            raise ModelLoadError(
                f"the EAGLE head's hidden size {config.hidden_size} is not the target's {target.config.hidden_size}"
            )
        self.config = config
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        variant = DecoderForCausalLM.make_variant(config)
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=fc_bias)
        self.layers = nn.ModuleList(
            DecoderLayer(config, variant, i, self.head_dim) for i in range(config.num_hidden_layers)
        )
        self.layers[0].input_layernorm = nn.Identity()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size) if own_embeddings else None
        """Its own embeddings, if its checkpoint has them; else the target's."""
        self.target = [target]  # in a list: not a submodule (its weights stay the target's)
        self.vocab: HeadVocab = TargetVocab(target)
        """The target's embeddings and LM head, or copies of them (`sonar.models.head_vocab`)."""
        self.rotary = RotaryEmbedding(
            rope_parameters(config), self.head_dim, getattr(config, "max_position_embeddings", 0)
        )
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = self.layers[0].self_attn.num_kv_heads

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        features: Tensor,
        kv_caches: list[Tensor],
        attn_metadata: AttentionMetadata,
    ) -> Tensor:
        """The head's hidden states ``[n, hidden]`` for tokens `input_ids` at `positions`, each
        beside the feature of the position before its token (the target's, or the head's own)."""
        with step_metadata(attn_metadata):
            embed = self.embed_tokens or self.vocab.embed_tokens
            x = self.fc(torch.cat((embed(input_ids).to(features.dtype), features), dim=-1))
            cos, sin = self.rotary.cos_sin(positions, x.dtype)
            residual = None
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                x, residual = layer(x, residual, cos, sin, kv_cache)
            return x + residual

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return self.vocab.compute_logits(hidden)

    def target_features(self, hidden: Tensor, rows: Tensor) -> Tensor:
        """The head's input features at batch rows `rows` of the target's step: its final states."""
        return hidden[rows]

    def greedy(self, hidden: Tensor) -> Tensor:
        """The argmax token of each row of the head's states."""
        return self.compute_logits(hidden)[:, : self.target[0].vocab_size].argmax(dim=-1)


def load_eagle_head(path: str, target: DecoderForCausalLM, dtype: torch.dtype, device: torch.device) -> EagleHead:
    """The head in directory `path` for `target` (ModelLoadError naming what does not fit)."""
    target.require_support(EAGLE)
    root = Path(path).expanduser()
    if not (root / "config.json").is_file():
        raise ModelLoadError(f"EAGLE head {path}: no config.json (a local directory is needed)")
    if not list(root.glob("*.safetensors")) and list(root.glob("*.bin")):
        raise ModelLoadError(
            f"EAGLE head {path}: only pickled .bin weights, which Sonar does not load (unpickling runs code); "
            "convert them to safetensors"
        )
    raw = json.loads((root / "config.json").read_text())
    raw.setdefault("vocab_size", target.config.vocab_size)
    raw.setdefault("rms_norm_eps", getattr(target.config, "rms_norm_eps", 1e-6))
    raw.setdefault("max_position_embeddings", getattr(target.config, "max_position_embeddings", 0))
    raw.setdefault("num_key_value_heads", raw.get("num_attention_heads"))
    config = SimpleNamespace(**raw)
    if any(sliding_windows(config)):
        raise ModelLoadError(f"EAGLE head {path}: sliding-window attention is not supported")
    tensors = {
        name.removeprefix("model."): tensor
        for name, tensor in iter_safetensors(safetensors_files(root))
        if not name.startswith("lm_head.")
    }
    if int(config.vocab_size) != target.vocab_size:
        raise ModelLoadError(
            f"EAGLE head {path}: vocabulary of {config.vocab_size} tokens, the target has {target.vocab_size}"
        )
    head = EagleHead(config, target, "fc.bias" in tensors, "embed_tokens.weight" in tensors)
    params = dict(head.named_parameters())
    stacked = stacked_params(head.layers[0])
    rows_written = dict.fromkeys(params, 0)
    for name, tensor in tensors.items():
        target_name, first, rows = fused_name(name, stacked)
        param = params.get(target_name)
        if param is None:
            raise ModelLoadError(f"EAGLE head {path}: unexpected weight {name}")
        dest = param.data if rows is None else param.data.narrow(0, first, rows)
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ModelLoadError(
                f"EAGLE head {path}: {name} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
            )
        dest.copy_(tensor)
        rows_written[target_name] += dest.shape[0]
    missing = [name for name, rows in rows_written.items() if rows != params[name].shape[0]]
    if missing:
        raise ModelLoadError(f"EAGLE head {path}: missing weights {sorted(missing)[:4]}")
    return head.to(device=device, dtype=dtype)

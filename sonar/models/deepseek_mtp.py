"""DeepSeek-V3's multi-token-prediction (MTP) layer: the draft of speculative ``method: mtp`` (as
the DeepSeek-V3 report and vLLM's ``deepseek_mtp`` define it).

The checkpoint stores ``num_nextn_predict_layers`` MTP layers after the main model's last layer
(``model.layers.{num_hidden_layers}.*``). At position ``p`` the layer takes the embedding of token
``p + 1`` (zero at position 0) and the target's final hidden state at ``p``, normalises each
(``enorm``, ``hnorm``), projects their concatenation (``eh_proj``: ``[2 * hidden] -> [hidden]``),
runs one DeepSeek decoder layer (MLA attention with its own KV cache, and the layer's MoE) and
returns ``hidden + residual``; ``shared_head.norm`` and the target's LM head give the logits. Later
drafts feed that output back in place of the target's state, through the same (first) MTP layer.

The embeddings and LM head are the target's: the checkpoint's copies under the MTP layer
(``embed_tokens``, ``shared_head.head``) are the main model's, as DeepSeek-V3 shares them, and are
not read.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from sonar.kernels.attention import AttentionMetadata
from sonar.kernels.attention_op import step_metadata
from sonar.models.decoder import RMSNorm
from sonar.models.errors import ModelLoadError
from sonar.models.head_vocab import HeadVocab, TargetVocab
from sonar.models.weights import iter_safetensors, safetensors_files

__all__ = ["MtpHead", "load_mtp_head", "mtp_layer_count"]

_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
_SHARED = ("embed_tokens.weight", "shared_head.head.weight")


class _Changed:
    """A config with some fields changed (configs come in several classes, not all copyable)."""

    def __init__(self, base: Any, **changes: Any) -> None:
        self.__dict__.update(changes)
        self._base = base

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)


def mtp_layer_count(config: Any) -> int:
    """How many MTP layers the checkpoint stores after the main model's."""
    return int(getattr(config, "num_nextn_predict_layers", None) or getattr(config, "num_mtp_layers", 0) or 0)


class MtpHead(nn.Module):
    def __init__(self, config: Any, target: Any, block: nn.Module) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.enorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = block
        """A `DeepseekDecoderLayer` (MLA and MoE) with the checkpoint's MTP weights."""
        self.shared_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.target = [target]  # in a list: not a submodule (its weights stay the target's)
        self.vocab: HeadVocab = TargetVocab(target)
        """The target's embeddings and LM head, or copies of them (`sonar.models.head_vocab`)."""
        self.num_layers = 1
        self.num_kv_heads = 1
        self.head_dim = target.head_dim

    def target_features(self, hidden: Tensor, rows: Tensor) -> Tensor:
        """The target's final hidden states at batch rows `rows`."""
        return hidden[rows]

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        features: Tensor,
        kv_caches: list[Tensor],
        attn_metadata: AttentionMetadata,
    ) -> tuple[Tensor, Tensor]:
        """(normed states for the logits, states to feed back) ``[n, hidden]``."""
        target = self.target[0]
        with step_metadata(attn_metadata):
            embeds = self.vocab.embed_tokens(input_ids).to(features.dtype)
            embeds = embeds.masked_fill((positions == 0).unsqueeze(-1), 0)  # no token before position 0
            x = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(features)), dim=-1))
            cos, sin = target.rotary.cos_sin(positions, x.dtype)
            [kv_cache] = kv_caches
            h, residual = self.block(x, None, cos, sin, kv_cache)
            out = h + residual
            return self.shared_norm(out), out

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return self.vocab.compute_logits(hidden)

    def greedy(self, hidden: Tensor) -> Tensor:
        return self.compute_logits(hidden)[:, : self.target[0].vocab_size].argmax(dim=-1)


def load_mtp_head(checkpoint: Path, target: Any, dtype: torch.dtype, device: torch.device) -> MtpHead:
    """The first MTP layer of the target's checkpoint directory (ModelLoadError naming what is missing)."""
    from sonar.models.deepseek import DeepseekV3ForCausalLM

    config = target.config
    if not isinstance(target, DeepseekV3ForCausalLM):
        raise ModelLoadError(
            f"speculative method mtp runs DeepSeek-V3's multi-token-prediction layers; {type(target).__name__} "
            "has none (use eagle, eagle3, draft_model, ngram or suffix)"
        )
    if mtp_layer_count(config) < 1:
        raise ModelLoadError("speculative method mtp: the checkpoint's config has no num_nextn_predict_layers")
    layer = config.num_hidden_layers
    # the MTP block is built as layer 0 of a one-layer model of the target's class (so its MLP is
    # the MoE a layer at that depth has) with a one-token vocabulary (its embeddings are unused)
    shadow = type(target)(
        _Changed(
            config,
            num_hidden_layers=1,
            vocab_size=1,
            first_k_dense_replace=0 if type(target).is_sparse(config, layer) else 1,
        )
    )
    prefix = re.compile(rf"model\.layers\.{layer}\.")
    own: dict[str, Tensor] = {}

    def block_weights() -> Any:
        for name, tensor in iter_safetensors(safetensors_files(Path(checkpoint))):
            if not prefix.match(name):
                continue
            rest = name[prefix.match(name).end() :]  # type: ignore[union-attr]
            if rest in _OWN:
                own[rest] = tensor
            elif rest not in _SHARED:
                yield f"model.layers.0.{rest}", tensor

    done = shadow.load_weights(block_weights())
    wanted = {name for name, _ in shadow.named_parameters() if name.startswith("model.layers.0.")}
    missing = sorted(wanted - done) + [f"model.layers.{layer}.{name}" for name in _OWN if name not in own]
    if missing:
        raise ModelLoadError(f"speculative method mtp: the checkpoint lacks MTP weights {missing[:4]}")
    head = MtpHead(config, target, shadow.model.layers[0])
    with torch.no_grad():
        for name, tensor in own.items():
            param = head.get_parameter(name.replace("shared_head.norm", "shared_norm"))
            if tuple(param.shape) != tuple(tensor.shape):
                raise ModelLoadError(
                    f"speculative method mtp: model.layers.{layer}.{name} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(param.shape)}"
                )
            param.copy_(tensor)
    return head.to(device=device, dtype=dtype)

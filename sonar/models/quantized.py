"""Putting quantized weights into a decoder: `install_quantized` swaps its linear layers (and a
quantized token embedding) for `QuantLinear` / `QuantEmbedding` modules.

The checkpoint's weights come keyed by Hugging Face module name (``model.layers.0.self_attn.q_proj``);
the decoder's fused matrices (``qkv_proj``, ``gate_up_proj``) take their parts stacked in row order
(`sonar.kernels.quant.stack_rows`, exact). A fused matrix whose parts are not all quantized, or
cannot share one layout (act-order permutations that differ), is served dequantized in the model's
dtype instead, with a warning: correct, only without the smaller weights there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import structlog
import torch
from torch import nn

from sonar.kernels.quant import QuantizationError, QuantizedWeight, dequantize, stack_rows
from sonar.kernels.quant_linear import Backend, QuantEmbedding, QuantLinear, ReferenceBackend, backend_for, quant_meta
from sonar.models.decoder import DecoderForCausalLM, VocabParallelLookup
from sonar.models.errors import ModelLoadError
from sonar.models.pack_cache import PackCache

log = structlog.get_logger(__name__)

EMBEDDING = "model.embed_tokens"


@dataclass
class Installed:
    """What `install_quantized` did: the modules now quantized, those served dequantized, and the
    bytes the quantized weights take."""

    quantized: list[str] = field(default_factory=list)
    dequantized: list[str] = field(default_factory=list)
    nbytes: int = 0
    formats: dict[str, int] = field(default_factory=dict)


def _fused_parts(model: DecoderForCausalLM) -> dict[str, list[tuple[str, int, int]]]:
    """Fused module name fragment -> its checkpoint parts (fragment, first row, rows) in row order."""
    parts: dict[str, list[tuple[str, int, int]]] = {}
    for part, (fused, first, rows) in model.stacked_params().items():
        parts.setdefault(fused, []).append((part, first, rows))
    for entries in parts.values():
        entries.sort(key=lambda e: e[1])
    return parts


def install_quantized(
    model: DecoderForCausalLM,
    weights: dict[str, QuantizedWeight],
    *,
    reference: bool = False,
    pack_cache: PackCache | None = None,
) -> Installed:
    """Replace, in place, the linear layers (and the embedding) that `weights` holds.

    Call it after the model's other weights are in place on their device (a linear's bias is
    kept). `reference`: use the torch reference backend (tests, and platforms without kernels).
    `pack_cache`: where the layers' packed weights are looked up first, and saved to after.
    Returns what was installed; a weight whose shape does not match its layer, or a name the
    model has no layer for, is a `ModelLoadError`.
    """
    backend: Backend | None = ReferenceBackend() if reference else None
    device = model.lm_head.weight.device if isinstance(model.lm_head, nn.Linear) else torch.device("cpu")
    dtype = model.model.norm.weight.dtype
    prepare = getattr(model, "prepare_quantized", None)  # a family's own layout (MoE experts)
    pending = dict(weights if prepare is None else prepare(weights))
    done = Installed()
    modules = dict(model.named_modules())

    def build(name: str, qw: QuantizedWeight, bias: torch.Tensor | None) -> QuantLinear:
        qw = qw.to(device)
        chosen = backend or backend_for(qw)
        cached = None if pack_cache is None else pack_cache.get(name, quant_meta(qw), chosen)
        layer = QuantLinear(qw, bias, chosen, packed=cached)
        if pack_cache is not None:
            pack_cache.put(name, layer.meta, chosen, layer.packed)
        return layer

    def place(name: str, qw: QuantizedWeight) -> None:
        linear = modules.get(name)
        if not isinstance(linear, nn.Linear):
            raise ModelLoadError(f"quantized weight for {name}, which is not a linear layer of {type(model).__name__}")
        if (qw.out_features, qw.in_features) != tuple(linear.weight.shape):
            raise ModelLoadError(
                f"quantized weight {name} is {qw.out_features}x{qw.in_features}, "
                f"the layer expects {tuple(linear.weight.shape)}"
            )
        layer = build(name, qw, linear.bias)
        parent, _, child = name.rpartition(".")
        setattr(modules[parent] if parent else model, child, layer)
        done.quantized.append(name)
        done.nbytes += layer.nbytes
        done.formats[qw.format] = done.formats.get(qw.format, 0) + 1

    for fused, parts in _fused_parts(model).items():
        for name in list(modules):
            if not name.endswith(fused.strip(".")):
                continue
            prefix = name[: -len(fused.strip("."))]
            names = [prefix + part.strip(".") for part, _, _ in parts]
            present = [n for n in names if n in pending]
            if not present:
                continue
            taken = [pending.pop(n) for n in present]
            if len(present) == len(names):
                try:
                    place(name, stack_rows(taken))
                    continue
                except QuantizationError as exc:
                    reason = str(exc)
            else:
                reason = f"only {', '.join(present)} of {', '.join(names)} are quantized"
            linear = modules[name]
            if not isinstance(linear, nn.Linear):
                raise ModelLoadError(f"{name} is not a linear layer")
            for (_, first, rows), n in zip(parts, names, strict=True):
                if n in present:
                    qw = taken[present.index(n)]
                    linear.weight.data.narrow(0, first, rows).copy_(dequantize(qw, linear.weight.dtype))
            done.dequantized.append(name)
            log.warning("model.quantized_layer_dequantized", layer=name, reason=reason)

    embedding = pending.pop(EMBEDDING, None)
    lm_head = pending.pop("lm_head", None)
    for name, qw in pending.items():
        place(name, qw)
    if lm_head is not None:
        place("lm_head", lm_head)
    if embedding is not None:
        emb = model.model.embed_tokens
        if (embedding.out_features, embedding.in_features) != tuple(emb.weight.shape):
            raise ModelLoadError(
                f"quantized embedding is {embedding.out_features}x{embedding.in_features}, "
                f"the model expects {tuple(emb.weight.shape)}"
            )
        if model.tie_word_embeddings:
            place("lm_head", embedding)
            source = model.lm_head
        else:
            source = build(EMBEDDING, embedding, None)
            done.nbytes += source.nbytes
        lookup: nn.Module = QuantEmbedding(source, dtype)
        if model.parallel.size > 1:  # this rank's rows of the vocabulary
            lookup = VocabParallelLookup(lookup, model.model.embed_tokens.first, model.parallel)
        model.model.embed_tokens = lookup
        done.quantized.append(EMBEDDING)
    if pack_cache is not None:
        pack_cache.save()
    return done

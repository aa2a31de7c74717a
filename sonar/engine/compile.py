"""``torch.compile`` of the decoder's forward pass, with its artifacts persisted across processes.

What is compiled: `DecoderForCausalLM.forward_tensors` (embedding, layers, final norm) over a
flat batch, with a dynamic token count, so a handful of graphs serve every step. Attention is the
opaque ``torch.ops.sonar.attention`` (`sonar.kernels.attention_op`); the step's
`AttentionMetadata` reaches it through `step_metadata`, never through the graph. Inductor fuses
what is left: the norms, the rotary embedding, casts, SiLU-and-mul and the residual adds. The
runner's prepacked CPU linears (`PackedLinear`) stay calls on their packed weights (Sonar's bf16
kernel or oneDNN), one opaque ``torch.ops.sonar.packed_linear`` each (Inductor cannot lower a
packed weight); the LM
head runs outside the graph, in `compute_logits`. ``freezing=True`` instead hands plain linears
to Inductor's own weight packing, which its FX graph cache cannot persist (see `compile_forward`).

The cache: artifacts live in ``$SONAR_CACHE_ROOT/torch_compile/<key>/`` (``SONAR_CACHE_ROOT``
defaults to ``~/.cache/sonar``), where ``key`` hashes everything that changes the generated code:
the model (class, config, dtype, identity), the engine settings the caller names, the
``SONAR_*`` variables in `CODE_ENV_VARS`, the Sonar version and model/kernel sources, the Python
and torch builds, the compile options, and the device (CPU ISA, or GPU name and capability).
Inductor's FX graph cache, the AOTAutograd cache and Triton's kernel cache all point into that
directory (``TORCHINDUCTOR_CACHE_DIR`` for the process; Triton's cache follows it). A warm start still
traces the model with Dynamo but skips Inductor's code generation and C++/Triton compilation.

``SONAR_FORCE_AOT_LOAD=1`` makes a miss an error (`CompileCacheMissError`) instead of a compile:
raised at once when the directory holds no completed warm-up (its ``manifest.json``), and by any
call whose compilation was not served from the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import sonar
from sonar import paths
from sonar.errors import SonarError
from sonar.kernels.attention import AttentionMetadata
from sonar.kernels.attention_op import step_metadata
from sonar.kernels.linear import PackedLinear, packed_forward
from sonar.log import get_logger

log = get_logger("sonar.compile")

FORCE_AOT_LOAD_ENV = "SONAR_FORCE_AOT_LOAD"
#: The ``SONAR_*`` variables that change the code a compiled forward pass runs (part of the key).
CODE_ENV_VARS = ("SONAR_USE_TRITON", "SONAR_DEVICE", "SONAR_NATIVE_KERNELS")
#: Token counts `CompiledForward.warm_up` runs by default: a single decode (Dynamo specializes a
#: size of 1) and a batch (that graph serves every step of two tokens or more, prefills included).
DEFAULT_WARMUP_TOKENS = (1, 16)
MANIFEST = "manifest.json"
#: Sonar's sources that define the traced code (package-relative): their digest is in the key.
_SOURCES = ("models", "kernels", "engine/compile.py")


class CompileCacheMissError(SonarError, RuntimeError):
    """``SONAR_FORCE_AOT_LOAD=1`` and the compile cache does not hold what a step needs."""


def force_aot_load() -> bool:
    """Whether ``SONAR_FORCE_AOT_LOAD`` asks for cache-only loading (1/true/yes)."""
    return os.environ.get(FORCE_AOT_LOAD_ENV, "").strip().lower() in ("1", "true", "yes")


def device_identity(device: torch.device) -> str:
    """What the generated code depends on in the device: the GPU's name and compute capability,
    or the CPU's vector ISA as torch sees it (and the machine's architecture)."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda:{torch.cuda.get_device_name(device)}:sm{major}{minor}"
    return f"{device.type}:{platform.machine()}:{torch.backends.cpu.get_cpu_capability()}"


def torch_identity() -> str:
    """The torch build: version, git revision, CUDA/HIP versions, and Triton's version if any."""
    parts = [
        torch.__version__,
        str(torch.version.git_version),
        f"cuda={torch.version.cuda}",
        f"hip={torch.version.hip}",
    ]
    try:
        import triton

        parts.append(f"triton={triton.__version__}")
    except ImportError:
        parts.append("triton=none")
    return " ".join(parts)


def sources_digest() -> str:
    """sha256 over the model and kernel packages and this module: a code change is a new key."""
    digest = hashlib.sha256()
    base = Path(sonar.__file__).parent
    for source in _SOURCES:
        paths = [base / source] if source.endswith(".py") else sorted((base / source).rglob("*.py"))
        for path in paths:
            digest.update(str(path.relative_to(base)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def model_identity(model: nn.Module) -> dict[str, str]:
    """The model's class, its config (as JSON where it has one), and its parameters' dtype."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        # Its stored attributes: the same whether transformers read config.json or a warm start
        # read them from the cache of resolved configs (sonar.models.config_cache).
        text = json.dumps(config.to_dict(), sort_keys=True, default=str)
    else:
        text = repr(config)
    param = next(model.parameters(), None)
    return {
        "class": f"{type(model).__module__}.{type(model).__qualname__}",
        "config_sha256": hashlib.sha256(text.encode()).hexdigest()[:16],
        "dtype": str(param.dtype) if param is not None else "none",
    }


def cache_key_parts(
    model: nn.Module,
    *,
    config_key_parts: Mapping[str, Any],
    device: torch.device,
    options: Mapping[str, Any],
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Everything the key hashes, as a JSON-able dict (also written next to the artifacts)."""
    env = os.environ if environ is None else environ
    return {
        "model": model_identity(model),
        "config": {str(k): repr(v) for k, v in sorted(config_key_parts.items())},
        "env": {name: env.get(name) for name in CODE_ENV_VARS},
        "sonar": sonar.__version__,
        "sources": sources_digest(),
        "python": sys.version.split()[0],
        "torch": torch_identity(),
        "device": device_identity(device),
        "options": {str(k): repr(v) for k, v in sorted(options.items())},
    }


def cache_key(parts: Mapping[str, Any]) -> str:
    """A short stable hash of `cache_key_parts`."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def _counter_snapshot() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {
        "fxgraph_hit": counters["inductor"]["fxgraph_cache_hit"],
        "fxgraph_miss": counters["inductor"]["fxgraph_cache_miss"],
        "fxgraph_bypass": counters["inductor"]["fxgraph_cache_bypass"],
        "aot_hit": counters["aot_autograd"]["autograd_cache_hit"],
        "aot_miss": counters["aot_autograd"]["autograd_cache_miss"],
    }


def _use_cache_dir(directory: Path) -> None:
    """Point this process's Inductor, AOTAutograd and Triton caches at `directory` (Triton's
    defaults to ``$TORCHINDUCTOR_CACHE_DIR/triton`` unless ``TRITON_CACHE_DIR`` is set)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    directory.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory / "inductor")
    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True


@torch.library.custom_op("sonar::packed_linear", mutates_args=())
def packed_linear(x: Tensor, weight: Tensor, packed: Tensor, bias: Tensor | None, native_layout: bool) -> Tensor:
    """`PackedLinear.forward` as one opaque operator (`sonar.kernels.linear.packed_forward`)."""
    return packed_forward(x, weight, packed, bias, native_layout)


@packed_linear.register_fake
def _packed_linear_fake(x: Tensor, weight: Tensor, packed: Tensor, bias: Tensor | None, native_layout: bool) -> Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


class CompilablePackedLinear(PackedLinear):
    """A `PackedLinear` that ``torch.compile`` keeps as one call to ``torch.ops.sonar.packed_linear``
    (Inductor cannot lower a packed weight); eager calls are `PackedLinear`'s."""

    def forward(self, x: Tensor) -> Tensor:
        if torch.compiler.is_compiling() and x.dim() == 2 and x.dtype == self.weight.dtype:
            return packed_linear(x, self.weight, self.packed, self.bias, self.native_layout)
        return super().forward(x)


def make_linears_compilable(module: nn.Module) -> int:
    """Turn every `PackedLinear` under `module` into a `CompilablePackedLinear`, in place (same
    parameters and packed weight); returns how many."""
    changed = 0
    for child in module.modules():
        if type(child) is PackedLinear:
            child.restore_weight()  # the graph takes it as an input
            child.__class__ = CompilablePackedLinear
            changed += 1
    return changed


def unpack_linears(module: nn.Module) -> int:
    """Replace every `PackedLinear` under `module` by an ``nn.Linear`` on the same parameters (the
    inverse of `sonar.kernels.linear.prepack_linears`); returns how many were replaced."""
    replaced = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear):
                child.restore_weight()
                plain = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
                plain.weight, plain.bias = child.weight, child.bias
                setattr(parent, name, plain)
                replaced += 1
    return replaced


class CompiledForward:
    """The runner's forward pass compiled: call it as ``(input_ids, positions, kv_caches, meta)``
    like the model; it returns the final hidden states ``[num_tokens, hidden_size]``.

    With `dynamic`, the token count and the KV caches' block count are the only dynamic sizes
    (everything else is fixed by the model), without duck sizing (a step whose token count equals
    the block count must not make a graph that requires it): one graph serves every step of
    more than one token, another (Dynamo specializes size 1) single-token steps. Without, every
    token count is a graph.

    The step's metadata is per thread (`step_metadata`) and calls are serialized by a lock, so
    steps may run in any thread. With `strict` (``SONAR_FORCE_AOT_LOAD=1``) a call that had to
    generate code instead of loading it from the cache raises `CompileCacheMissError`.
    """

    def __init__(
        self, model: nn.Module, directory: Path, key: str, *, dynamic: bool, options: dict[str, Any], strict: bool
    ) -> None:
        self.model = model
        self.directory = directory
        self.key = key
        self.strict = strict
        self._lock = threading.Lock()
        self._options = options
        self.dynamic = dynamic
        self.compile_seconds = 0.0
        """Time spent in calls that made a new graph (tracing, and compiling or loading it)."""
        for module in model.modules():
            if getattr(module, "untraced", False):
                module.forward = torch.compiler.disable(module.forward)
        self._body: Callable[..., Tensor] = torch.compile(model.forward_tensors, dynamic=None if dynamic else False)

    def __call__(
        self, input_ids: Tensor, positions: Tensor, kv_caches: list[Tensor], meta: AttentionMetadata
    ) -> Tensor:
        import torch._inductor.config as inductor_config
        import torch.fx.experimental._config as shape_config
        from torch._dynamo.utils import counters

        if self.dynamic:
            torch._dynamo.maybe_mark_dynamic(input_ids, 0)
            torch._dynamo.maybe_mark_dynamic(positions, 0)
            for cache in kv_caches:
                torch._dynamo.maybe_mark_dynamic(cache, 1)
        # Inductor reads `freezing` when it compiles, which happens inside a call (the first of a
        # shape class): ``torch.compile(options=...)`` did not reach it (measured, torch 2.13), a
        # patch around every call does, for ~20 us, without changing the process's defaults
        with (
            self._lock,
            step_metadata(meta),
            inductor_config.patch(self._options),
            shape_config.patch(use_duck_shape=False),
        ):
            graphs = counters["stats"]["unique_graphs"]
            before = _counter_snapshot()
            started = time.perf_counter()
            out = self._body(input_ids, positions, kv_caches)
            if counters["stats"]["unique_graphs"] != graphs:
                self._compiled(input_ids.shape[0], before, time.perf_counter() - started)
        return out

    def _compiled(self, num_tokens: int, before: dict[str, int], seconds: float) -> None:
        """Log a call that produced a new graph; under `strict`, fail if it was not loaded."""
        self.compile_seconds += seconds
        delta = {k: v - before[k] for k, v in _counter_snapshot().items()}
        missed = delta["fxgraph_miss"] + delta["fxgraph_bypass"]
        log.info(
            "compile.new_graph",
            tokens=num_tokens,
            seconds=round(seconds, 2),
            cache="miss" if missed else "hit",
            fxgraph_hits=delta["fxgraph_hit"],
            fxgraph_misses=delta["fxgraph_miss"],
            fxgraph_bypasses=delta["fxgraph_bypass"],
            key=self.key,
        )
        if self.strict and missed:
            raise CompileCacheMissError(
                f"{FORCE_AOT_LOAD_ENV}=1 but a step of {num_tokens} tokens needed a graph the compile cache does "
                f"not hold (key {self.key}, {self.directory}): warm the cache up with this size without "
                f"{FORCE_AOT_LOAD_ENV}"
            )

    def warm_up(
        self, kv_caches: list[Tensor], block_size: int, token_counts: Iterable[int] = DEFAULT_WARMUP_TOKENS
    ) -> dict[str, Any]:
        """Compile (or load) the graphs the runner's steps will need, by running one step of each
        token count on KV block 0 onwards (what the runner's own warm-up does: nothing is cached
        there yet, and the scheduler overwrites it before any attention reads it). Each count
        ``n`` runs as one sequence of ``n`` new tokens when ``n`` exceeds `block_size`, else as ``n``
        decoding sequences of `block_size` tokens of context. Writes ``manifest.json`` and returns its
        contents: seconds, graphs, and the cache's hits and misses."""
        started = time.perf_counter()
        first = _counter_snapshot()
        device = kv_caches[0].device
        num_blocks = kv_caches[0].shape[1]
        counts = sorted(set(token_counts))
        with torch.inference_mode():
            for n in counts:
                if n > block_size:
                    blocks = -(-n // block_size)
                    if blocks > num_blocks:
                        raise ValueError(
                            f"a warm-up step of {n} tokens needs {blocks} KV blocks, the cache has {num_blocks}"
                        )
                    meta = AttentionMetadata.build([n], [n], [list(range(blocks))], block_size, device=device)
                    positions = torch.arange(n, device=device)
                else:
                    meta = AttentionMetadata.build([1] * n, [block_size] * n, [[0]] * n, block_size, device=device)
                    positions = torch.full((n,), block_size - 1, device=device)
                ids = torch.zeros(n, dtype=torch.int64, device=device)
                self(ids, positions, kv_caches, meta)
        seconds = time.perf_counter() - started
        after = _counter_snapshot()
        delta = {k: after[k] - first[k] for k in after}
        manifest = {
            "key": self.key,
            "token_counts": counts,
            "seconds": round(seconds, 3),
            **delta,
            "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        (self.directory / MANIFEST).write_text(json.dumps(manifest, indent=1))
        state = "hit" if delta["fxgraph_miss"] + delta["fxgraph_bypass"] == 0 else "miss"
        log.info(
            "compile.warmed_up",
            cache=state,
            seconds=round(seconds, 2),
            token_counts=counts,
            fxgraph_hits=delta["fxgraph_hit"],
            fxgraph_misses=delta["fxgraph_miss"],
            aot_hits=delta["aot_hit"],
            aot_misses=delta["aot_miss"],
            directory=str(self.directory),
        )
        return manifest


def compile_forward(
    model: nn.Module,
    *,
    config_key_parts: Mapping[str, Any],
    cache_root: str | Path | None = None,
    dynamic: bool = True,
    freezing: bool = False,
) -> CompiledForward:
    """Compile `model`'s forward pass (a `DecoderForCausalLM`), caching under `cache_root`.

    `config_key_parts`: the engine settings that change the compiled code or its inputs (at
    least the model's name or path, its revision, the dtype, the KV block size and cache dtype);
    they go into the cache key. `cache_root` defaults to `sonar.paths.cache_root`. Nothing compiles
    here: the first call of each new shape class does, or `CompiledForward.warm_up`. With
    ``SONAR_FORCE_AOT_LOAD=1`` a cache directory without a completed warm-up raises
    `CompileCacheMissError` now, and a call whose graph was not in the cache raises it then.

    The layers' `PackedLinear` (the runner's prepacked CPU linears) become
    `CompilablePackedLinear` in place: opaque calls on their packed weights inside the compiled graph, unchanged
    eager behaviour. With `freezing` they become plain ``nn.Linear`` instead, and Inductor treats
    the weights as constants and packs them itself; but a graph holding oneDNN-packed constants
    cannot be pickled, so Inductor's FX graph cache bypasses it and every start compiles anew
    (measured: ``fxgraph_cache_bypass``, "mkldnn tensors unpickleable", torch 2.13). Off by default.
    """
    options: dict[str, Any] = {"freezing": freezing}
    device = next(model.parameters()).device
    root = Path(cache_root) if cache_root is not None else paths.cache_root()
    parts = cache_key_parts(
        model, config_key_parts=config_key_parts, device=device, options={**options, "dynamic": dynamic}
    )
    key = cache_key(parts)
    directory = root / "torch_compile" / key
    strict = force_aot_load()
    manifest = directory / MANIFEST
    if strict and not manifest.is_file():
        raise CompileCacheMissError(
            f"{FORCE_AOT_LOAD_ENV}=1 but the compile cache has no artifacts for this model and configuration "
            f"(key {key}, looked in {directory}): run once without {FORCE_AOT_LOAD_ENV} to populate it, or check "
            f"that {paths.CACHE_ROOT_ENV}, the model, its configuration, the torch build and the device match"
        )
    _use_cache_dir(directory)
    (directory / "key.json").write_text(json.dumps(parts, indent=1, sort_keys=True))
    log.info("compile.cache", key=key, directory=str(directory), warmed=manifest.is_file(), force_aot_load=strict)
    # the rotary tables are cached per device on first use: fill that cache now, in eager, or
    # the first graph would trace the insertion and guard on the cache being empty (a recompile)
    model.rotary.cos_sin(torch.zeros(1, dtype=torch.int64, device=device), next(model.parameters()).dtype)
    if freezing:
        unpack_linears(model.model)
    else:
        make_linears_compilable(model.model)
    return CompiledForward(model, directory, key, dynamic=dynamic, options=options, strict=strict)

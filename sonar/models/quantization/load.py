"""Loading a quantized safetensors checkpoint into a model: `load_quantized_checkpoint`.

The tensor names are read first (the files' headers only), so that each module is known to be
quantized or not before any tensor arrives: a quantized module's tensors (`Method.parts`) are
gathered until the module is complete, converted into a `QuantizedWeight` and dropped; every
other tensor goes to ``model.load_weights`` as in an unquantized load. Finally the converted
weights replace their linear layers (`sonar.models.quantized.install_quantized`, q/k/v and gate/up
stacked into the fused layers; a fused layer whose parts are not all quantized alike is served
dequantized).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import structlog
from torch import Tensor

from sonar.kernels.quant import QuantizedWeight
from sonar.models.decoder import DecoderForCausalLM
from sonar.models.errors import ModelLoadError
from sonar.models.quantization.method import Method
from sonar.models.quantized import Installed, install_quantized
from sonar.models.weights import iter_safetensors, safetensors_files

log = structlog.get_logger(__name__)


def tensor_names(files: list[Path]) -> list[str]:
    """Every tensor name of the files, from their headers."""
    from safetensors import safe_open

    names: list[str] = []
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                names += list(handle.keys())
        except Exception as exc:
            raise ModelLoadError(f"corrupt safetensors file {path}: {exc}") from exc
    return names


def quantized_modules(names: list[str], method: Method) -> dict[str, set[str]]:
    """Module -> the parts it has, for each module the checkpoint stores quantized."""
    parts_of: dict[str, set[str]] = {}
    for name in names:
        module, _, part = name.rpartition(".")
        if part in method.parts:
            parts_of.setdefault(module, set()).add(part)
    found = {module: parts for module, parts in parts_of.items() if method.quantized(module, parts)}
    for module in found:
        if method.modules.fullmatch(module) is None:
            raise ModelLoadError(f"{module} is stored quantized; Sonar serves {method.serves} only")
    if not found:
        raise ModelLoadError(f"quantization method {method.name}, but the checkpoint stores no layer quantized")
    return found


def load_quantized_checkpoint(
    model: DecoderForCausalLM,
    model_dir: Path,
    method: Method,
    source: str,
    *,
    dequantize_weights: bool = False,
    skip: Callable[[str], bool] | None = None,
) -> Installed:
    """Load the safetensors checkpoint in `model_dir` into `model` (built on its device), the
    modules `method` finds quantized as quantized layers; returns what was installed.

    `dequantize_weights`: the quantized modules' weights are dequantized (exactly, then cast to
    the model's dtype) into the ordinary linear layers instead, the reference path. `skip`: tensor
    names never read (``--enable-ep-weight-filter``: other expert-parallel ranks' experts). Every
    failure is a ModelLoadError naming `source`.
    """
    try:
        return _load(model, model_dir, method, dequantize_weights, skip)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{source}: {exc}") from exc


def _load(
    model: DecoderForCausalLM,
    model_dir: Path,
    method: Method,
    dequantize_weights: bool,
    skip: Callable[[str], bool] | None,
) -> Installed:
    files = safetensors_files(model_dir)
    plan = quantized_modules([n for n in tensor_names(files) if skip is None or not skip(n)], method)
    pending: dict[str, dict[str, Tensor]] = {}
    converted: dict[str, QuantizedWeight] = {}
    plain: set[str] = set()

    def plain_tensors() -> Iterator[tuple[str, Tensor]]:
        for name, tensor in iter_safetensors(files, "lazy", skip):
            module, _, part = name.rpartition(".")
            if module in plan and part in method.parts:
                got = pending.setdefault(module, {})
                got[part] = tensor
                if len(got) == len(plan[module]):
                    if dequantize_weights:
                        yield from method.dequantized(module, pending.pop(module))
                    else:
                        converted.update(method.converted(module, pending.pop(module)))
                continue
            if part == "weight" and not (tensor.is_floating_point() and tensor.element_size() >= 2):
                raise ModelLoadError(
                    f"{name} is stored as {tensor.dtype} without the tensors {method.name} quantization "
                    "gives a quantized layer (its scales)"
                )
            plain.add(name)
            yield name, tensor

    loaded = model.load_weights(plain_tensors())
    installed = install_quantized(model, model.shard_quantized(converted))
    loaded |= _dequantized_complete(model, installed.dequantized, plain, set(converted))
    expected = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    missing = sorted(expected - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"checkpoint lacks weights for {shown}")
    log.info(
        "model.quantized",
        method=method.name,
        dequantize_weights=dequantize_weights,
        layers=len(plan),
        quantized=len(installed.quantized),
        served_dequantized=len(installed.dequantized),
        quantized_bytes=installed.nbytes,
        **method.describe(),
    )
    return installed


def _dequantized_complete(
    model: DecoderForCausalLM, fused: list[str], plain: set[str], converted: set[str]
) -> set[str]:
    """The weights of fused layers served dequantized that are complete: each part either
    quantized (and dequantized into its rows by `install_quantized`) or loaded plain."""
    complete = set()
    for name in fused:
        parts = [part.strip(".") for part, (f, _, _) in model.stacked_params().items() if name.endswith(f.strip("."))]
        prefix = name.rpartition(".")[0]
        if all(f"{prefix}.{p}" in converted or f"{prefix}.{p}.weight" in plain for p in parts):
            complete.add(f"{name}.weight")
    return complete

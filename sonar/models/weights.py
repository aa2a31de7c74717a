"""Reading checkpoint tensors, and dummy weights.

A checkpoint's tensors reach the model as a stream of ``(name, tensor)`` that `load_weights`
copies into the parameters as they arrive, so no more than a few tensors are resident beside the
model at a time, whatever the checkpoint's size:

* safetensors (`iter_safetensors`): one file or the shards a ``model.safetensors.index.json``
  names, read one tensor at a time. ``lazy`` (the default) memory-maps each file; ``eager`` reads
  a whole file into memory first (one shard resident), which suits network file systems;
* safetensors read in parallel (`iter_safetensors_parallel`, ``--load-format runai_streamer``):
  a pool of reader threads, one shard per reader at a time, handing tensors over a bounded queue;
* PyTorch ``.bin`` files (`iter_pt`, ``--load-format pt``): ``torch.load`` with
  ``weights_only=True`` (no pickled code runs) and ``mmap=True``.
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from sonar.models.errors import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"
PT_INDEX_FILE = "pytorch_model.bin.index.json"


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of a directory: those its sharded index names, else every ``*.safetensors``."""
    files = _indexed(model_dir, INDEX_FILE)
    if files is not None:
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {model_dir}")
    return files


def pt_files(model_dir: Path) -> list[Path]:
    """The PyTorch weight files of a directory: those ``pytorch_model.bin.index.json`` names, else
    every ``*.bin`` but a trainer's ``training_args.bin``."""
    files = _indexed(model_dir, PT_INDEX_FILE)
    if files is not None:
        return files
    files = sorted(p for p in model_dir.glob("*.bin") if p.name != "training_args.bin")
    if not files:
        raise ModelLoadError(f"no *.bin weights in {model_dir}")
    return files


def has_safetensors(model_dir: Path) -> bool:
    return (model_dir / INDEX_FILE).is_file() or any(model_dir.glob("*.safetensors"))


def _indexed(model_dir: Path, index_name: str) -> list[Path] | None:
    index = model_dir / index_name
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"corrupt weights index {index}: {exc}") from exc
    files = [model_dir / name for name in sorted(set(weight_map.values()))]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(f"{index} names shards that are missing: {', '.join(missing)}")
    return files


def iter_safetensors(
    files: list[Path], strategy: str = "lazy", skip: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor of every file; a file that cannot be read raises ModelLoadError.
    `skip`: names never read (``lazy`` only: ``eager`` has read the whole file already) nor yielded."""
    for path in files:
        if strategy == "eager":
            yield from ((n, t) for n, t in _read_whole(path).items() if skip is None or not skip(n))
        else:
            yield from _iter_mapped(path, skip)


def _iter_mapped(path: Path, skip: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
        names = list(handle.keys())
    except Exception as exc:
        raise ModelLoadError(f"corrupt safetensors file {path}: {exc}") from exc
    for name in names:
        if skip is not None and skip(name):
            continue
        try:
            tensor = handle.get_tensor(name)
        except Exception as exc:
            raise ModelLoadError(f"corrupt safetensors file {path}: tensor {name}: {exc}") from exc
        yield name, tensor


def _read_whole(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    try:
        return load(path.read_bytes())
    except Exception as exc:
        raise ModelLoadError(f"corrupt safetensors file {path}: {exc}") from exc


_DONE = object()


def iter_safetensors_parallel(files: list[Path], concurrency: int) -> Iterator[tuple[str, torch.Tensor]]:
    """`iter_safetensors` with `concurrency` reader threads, each reading one shard at a time.

    Tensors arrive in no fixed order across shards. Memory stays bounded: the queue between the
    readers and the consumer holds at most ``2 * concurrency`` tensors, and a reader waits (holding
    one tensor) while it is full. The first error of any reader is raised here; the others stop.
    """
    if concurrency < 1:
        raise ModelLoadError(f"model loader concurrency must be at least 1, got {concurrency}")
    todo: queue.SimpleQueue[Path] = queue.SimpleQueue()
    for path in files:
        todo.put(path)
    ready: queue.Queue[object] = queue.Queue(maxsize=2 * concurrency)
    stop = threading.Event()

    def hand_over(item: object) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def read() -> None:
        try:
            while not stop.is_set():
                try:
                    path = todo.get_nowait()
                except queue.Empty:
                    break
                for item in _iter_mapped(path):
                    if not hand_over(item):
                        return
        except BaseException as exc:  # raised by the consumer
            hand_over(exc)
        finally:
            hand_over(_DONE)

    readers = [
        threading.Thread(target=read, name=f"weights-reader-{i}", daemon=True)
        for i in range(min(concurrency, len(files)))
    ]
    for thread in readers:
        thread.start()
    running = len(readers)
    try:
        while running:
            item = ready.get()
            if item is _DONE:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item  # type: ignore[misc]
    finally:
        stop.set()
        for thread in readers:
            thread.join()


def iter_pt(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor of PyTorch checkpoint files, loaded with ``weights_only=True``
    (a file that needs arbitrary unpickling is refused, never run) and memory-mapped."""
    for path in files:
        try:
            state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:
            raise ModelLoadError(f"cannot read PyTorch weights {path} (loaded with weights_only=True): {exc}") from exc
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise ModelLoadError(f"{path} is not a state dict of tensors")
        yield from state.items()
        del state


def init_dummy_weights(model: nn.Module, std: float = 0.02, seed: int = 0) -> None:
    """Random weights for benchmarks and tests without a checkpoint: norms 1, biases 0, the rest
    N(0, std) drawn from a generator seeded with `seed` (the same model and seed, the same weights)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in model.named_parameters():
        data = param.data
        if name.lower().endswith("norm.weight"):  # RMSNorm and BERT's LayerNorm
            data.fill_(1.0)
        elif name.endswith(".bias"):
            data.zero_()
        else:
            values = torch.empty(data.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
            data.copy_(values)

"""Sleep mode on the worker's side: what sleeping and waking do to the `ModelRunner`.

The transitions are decided by `sonar.core.sleep`; this module carries them out, in the worker's
thread, between steps (the scheduler sends `Sleep` only once no request runs):

* level 1 frees the KV cache tensors and moves the weights to host memory (on the CPU they
  stay, since host memory is where they are);
* level 2 drops the whole runner (weights, KV cache, CUDA graphs), and waking the weights builds
  a new one from the checkpoint, with the same number of KV blocks and context length, so the
  scheduler's block manager still fits it.

Freed memory is handed back to the system, not only to an allocator's free list: CUDA's caching
allocator is emptied, and glibc's heap trimmed (`malloc_trim`), so the process's resident size
drops by what was freed (measured in `tests/engine/test_sleep.py`).
"""

from __future__ import annotations

import ctypes
import ctypes.util

import msgspec
import torch

from sonar import heap
from sonar.core.sleep import SleepState, plan_sleep, plan_wake
from sonar.engine.config import EngineConfig
from sonar.engine.runner import ModelRunner
from sonar.errors import SonarError
from sonar.log import get_logger

log = get_logger("sonar.worker")


class WorkerAsleepError(SonarError, RuntimeError):
    """A step reached a sleeping worker (the scheduler sends none while it sleeps)."""


def release_memory(device: torch.device) -> None:
    """Give what was just freed back to the system (a runner built before its process froze its
    start's heap included: `heap.collect_all`)."""
    heap.collect_all()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        return
    name = ctypes.util.find_library("c")
    if name is not None:
        try:
            ctypes.CDLL(name).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc: its free lists keep the pages
            pass


class SleepingRunner:
    """The worker's runner with its sleep state: `runner` is None while the weights sleep at
    level 2. `layout` (blocks, context length) is what a rebuilt runner must have."""

    def __init__(self, config: EngineConfig, runner: ModelRunner) -> None:
        self.config = config
        self.runner: ModelRunner | None = runner
        self.device = runner.device
        self.layout = (runner.num_blocks, runner.max_model_len)
        self.state = SleepState()

    def sleep(self, level: int) -> SleepState:
        """Sleep at `level` (a repeated sleep at the same level changes nothing)."""
        new = plan_sleep(self.state, level)
        if new is None:
            return self.state
        runner = self.runner
        assert runner is not None
        if level == 2:
            if runner.compiled is not None:  # dynamo's caches hold the compiled graphs' weights
                torch._dynamo.reset()
            self.runner = runner = None
        else:
            runner.free_kv_cache()
            runner.offload_weights()
        release_memory(self.device)
        self.state = new
        log.info("worker.asleep", level=level)
        return new

    def wake(self, tags: list[str]) -> SleepState:
        """Wake `tags` (weights before the KV cache)."""
        new, waking = plan_wake(self.state, tags)
        for tag in waking:
            if tag == "weights" and self.runner is None:
                self.runner = self._rebuild(kv_asleep="kv_cache" in new.asleep)
            elif tag == "weights":
                self.runner.restore_weights()
            elif self.runner is not None:
                self.runner.allocate_kv_cache()
            # else: level 2 with the weights still asleep; the rebuilt runner brings its cache
        self.state = new
        log.info("worker.awake" if not new.is_sleeping else "worker.waking", woke=",".join(waking))
        return new

    def _rebuild(self, kv_asleep: bool) -> ModelRunner:
        """A runner loaded again from the checkpoint, with the KV layout of the first."""
        num_blocks, max_model_len = self.layout
        config = msgspec.structs.replace(self.config, num_gpu_blocks_override=num_blocks, max_model_len=max_model_len)
        runner = ModelRunner(config, device=self.device)
        if kv_asleep:
            runner.free_kv_cache()
            release_memory(self.device)
        return runner

"""``--profiler-config``: torch's profiler around the worker's steps, started and stopped at will.

`ProfilerConfig` is the flag's value (its documented fields, their documented defaults). With
``profiler`` set to ``torch``, ``POST /start_profile`` (`LLM.start_profile`) starts
`torch.profiler` in every worker, and ``POST /stop_profile`` stops it and writes one Chrome trace
per worker into ``torch_profiler_dir`` (``sonar-<worker>-<pid>-<time>.pt.trace.json``, gzipped
when ``torch_profiler_use_gzip``), which Perfetto (ui.perfetto.dev) and chrome://tracing open.
``delay_iterations`` steps run before recording starts; ``max_iterations`` (0: no limit) steps
later it stops and writes the trace by itself. ``torch_profiler_dump_cuda_time_total`` also
writes the operators' totals as a table (``sonar-<worker>-<pid>-<time>.ops.txt``), sorted by
CUDA time on a GPU and by CPU time on the CPU.

Settings Sonar does not implement are refused when they differ from their default: the ``cuda``
profiler (Nsight's capture range), a trace directory that is a URI, and the profiler schedule and
annotation fields. The configuration is checked without importing torch (flag parsing must not).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import msgspec

from sonar.log import get_logger

log = get_logger("sonar.worker")

#: Fields of the documented configuration that only take their default value in Sonar, and why.
NOT_SUPPORTED = {
    "capture_torch_profiler": "capturing the torch profiler from a CUDA profiler",
    "detailed_trace_annotation": "detailed trace annotations",
    "ignore_frontend": "leaving out the frontend (Sonar profiles only the workers)",
    "warmup_iterations": "a profiler schedule (warmup iterations)",
    "active_iterations": "a profiler schedule (active iterations)",
    "wait_iterations": "a profiler schedule (wait iterations)",
}


class ProfilerConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    profiler: str | None = None
    """``torch`` to profile; None (or ``none``): off."""
    torch_profiler_dir: str = ""
    torch_profiler_with_stack: bool = True
    torch_profiler_with_flops: bool = False
    torch_profiler_use_gzip: bool = True
    torch_profiler_dump_cuda_time_total: bool = True
    torch_profiler_record_shapes: bool = False
    torch_profiler_with_memory: bool = False
    capture_torch_profiler: bool = False
    detailed_trace_annotation: bool = False
    ignore_frontend: bool = False
    delay_iterations: int = 0
    max_iterations: int = 0
    warmup_iterations: int = 0
    active_iterations: int = 5
    wait_iterations: int = 0

    @classmethod
    def parse(cls, raw: dict[str, Any] | None) -> "ProfilerConfig | None":
        """The configuration of the flag's value, None when profiling is off; ValueError naming
        the field that is wrong or not supported."""
        try:
            config = msgspec.convert(raw or {}, cls)
        except msgspec.ValidationError as exc:
            raise ValueError(f"--profiler-config: {exc}") from None
        config.check()
        return config if config.profiler == "torch" else None

    def check(self) -> None:
        defaults = ProfilerConfig()
        if self.profiler not in (None, "none", "torch", "cuda"):
            raise ValueError(f"--profiler-config.profiler must be torch, cuda or none, got {self.profiler!r}")
        if self.profiler == "cuda":
            raise ValueError(
                "--profiler-config.profiler cuda (an Nsight capture range) is not supported yet; use torch"
            )
        if self.profiler != "torch":
            given = [f for f in self.__struct_fields__ if f != "profiler" and getattr(self, f) != getattr(defaults, f)]
            if given:
                raise ValueError(f"--profiler-config.{given[0]} is set but profiling is off: add profiler torch")
            return
        if not self.torch_profiler_dir:
            raise ValueError("--profiler-config.profiler torch needs torch_profiler_dir, where the traces go")
        if "://" in self.torch_profiler_dir:
            raise ValueError(
                f"--profiler-config.torch_profiler_dir {self.torch_profiler_dir!r}: a URI is not supported yet; "
                "give a local directory"
            )
        for name in ("delay_iterations", "max_iterations"):
            if getattr(self, name) < 0:
                raise ValueError(f"--profiler-config.{name} must not be negative, got {getattr(self, name)}")
        for name, what in NOT_SUPPORTED.items():
            if getattr(self, name) != getattr(defaults, name):
                raise ValueError(f"--profiler-config.{name}: {what} is not supported yet; leave it at its default")

    @property
    def directory(self) -> Path:
        return Path(self.torch_profiler_dir).expanduser().absolute()


class TraceProfiler:
    """torch's profiler for one worker: started, stepped after each of its steps, stopped.

    Every call must come from the thread that runs the steps: torch's profiler records only the
    operators of the thread that started it (and crashes when stopped from another), so a worker
    with a profiler runs its steps in one thread of its own (`sonar.engine.worker`)."""

    def __init__(self, config: ProfilerConfig, name: str, device_type: str) -> None:
        self.config = config
        self.name = name
        self.device_type = device_type
        self._profile: Any = None
        self._delay = 0
        """Steps still to run before recording starts (``delay_iterations``)."""
        self._steps = 0

    @property
    def running(self) -> bool:
        """Started and not stopped (recording, or waiting out its delay)."""
        return self._profile is not None or self._delay > 0

    def start(self) -> None:
        """Start recording, after ``delay_iterations`` steps (a second start changes nothing)."""
        if self.running:
            return
        self.config.directory.mkdir(parents=True, exist_ok=True)
        self._delay = self.config.delay_iterations
        if self._delay == 0:
            self._begin()
        log.info("profiler.started", worker=self.name, delay_steps=self._delay)

    def step(self) -> list[str]:
        """After a step: begin once the delay is over; stop at ``max_iterations`` steps recorded,
        returning the files written."""
        if self._delay > 0:
            self._delay -= 1
            if self._delay == 0:
                self._begin()
            return []
        if self._profile is None:
            return []
        self._steps += 1
        limit = self.config.max_iterations
        return self.stop() if limit and self._steps >= limit else []

    def stop(self) -> list[str]:
        """Stop and write the trace (and the operators' table); the files written."""
        self._delay = 0
        profile, self._profile = self._profile, None
        if profile is None:  # stopped before it began (still in its delay), or never started
            return []
        profile.__exit__(None, None, None)
        cfg = self.config
        stem = cfg.directory / f"sonar-{self.name}-{os.getpid()}-{time.time_ns()}"
        trace = f"{stem}.pt.trace.json" + (".gz" if cfg.torch_profiler_use_gzip else "")
        profile.export_chrome_trace(trace)
        written = [trace]
        if cfg.torch_profiler_dump_cuda_time_total:
            sort = "self_cuda_time_total" if self.device_type == "cuda" else "self_cpu_time_total"
            table = f"{stem}.ops.txt"
            Path(table).write_text(profile.key_averages().table(sort_by=sort, row_limit=-1))
            written.append(table)
        log.info("profiler.stopped", worker=self.name, steps=self._steps, trace=trace)
        return written

    def _begin(self) -> None:
        import torch.profiler

        cfg = self.config
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device_type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(
            activities=activities,
            record_shapes=cfg.torch_profiler_record_shapes,
            profile_memory=cfg.torch_profiler_with_memory,
            with_stack=cfg.torch_profiler_with_stack,
            with_flops=cfg.torch_profiler_with_flops,
        )
        self._profile.__enter__()
        self._steps = 0

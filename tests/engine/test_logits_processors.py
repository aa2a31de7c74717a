"""`ProcessorChain`: the `BatchUpdate` a processor sees as requests join, leave and change rows
(vLLM's meaning: rows newly holding a request are added, rows left empty removed), greedy steps
skipping argmax-invariant processors, and the loading errors of --logits-processors."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

from sonar.engine.logits_processors import BatchUpdate, LogitsProcessorError, ProcessorChain, load_classes
from sonar.errors import SonarError
from sonar.sampling_params import SamplingParams


class Recorder:
    """Keeps every update and the per-row target its requests asked for; forces that token."""

    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.updates: list[BatchUpdate | None] = []
        self.targets: dict[int, int] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, update: BatchUpdate | None) -> None:
        self.updates.append(update)
        if update is None:
            return
        for row, params, _, _ in update.added:
            target = (params.extra_args or {}).get("target_token")
            if target is None:
                self.targets.pop(row, None)
            else:
                self.targets[row] = target
        for row in update.removed:
            self.targets.pop(row, None)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, target in self.targets.items():
            logits[row] = float("-inf")
            logits[row, target] = 0.0
        return logits


class Invariant(Recorder):
    def is_argmax_invariant(self) -> bool:
        return True

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        raise AssertionError("an argmax-invariant processor runs on a greedy step")


def step(chain: ProcessorChain, rows: list[tuple[str, SamplingParams]], greedy: bool = False) -> torch.Tensor:
    keys = [(rid, 0) for rid, _ in rows]
    params = [p for _, p in rows]
    return chain.apply(torch.zeros(len(rows), 8), keys, params, [[1]] * len(rows), [[]] * len(rows), greedy)


def test_rows_added_kept_removed_and_replaced() -> None:
    proc = Recorder(None, torch.device("cpu"), False)
    chain = ProcessorChain([proc])
    a, b, c = (
        SamplingParams(extra_args={"target_token": 3}),
        SamplingParams(),
        SamplingParams(extra_args={"target_token": 5}),
    )
    logits = step(chain, [("a", a), ("b", b)])
    first = proc.updates[-1]
    assert first is not None and [row for row, *_ in first.added] == [0, 1] and not first.removed
    assert logits[0].argmax() == 3 and torch.all(logits[1] == 0)
    step(chain, [("a", a), ("b", b)])
    assert proc.updates[-1] is None  # nothing changed
    logits = step(chain, [("c", c)])  # a and b finished; c takes row 0
    update = proc.updates[-1]
    assert update is not None and update.batch_size == 1
    assert [(row, p) for row, p, *_ in update.added] == [(0, c)] and list(update.removed) == [1]
    assert logits[0].argmax() == 5


def test_a_greedy_step_skips_argmax_invariant_processors() -> None:
    proc = Invariant(None, torch.device("cpu"), False)
    chain = ProcessorChain([proc])
    step(chain, [("a", SamplingParams(temperature=0.0))], greedy=True)
    assert proc.updates[-1] is not None  # its state still follows the batch
    with pytest.raises(AssertionError, match="greedy step"):
        step(chain, [("a", SamplingParams())])


def test_loading_names_what_is_wrong() -> None:
    module = sys.modules[__name__].__name__
    assert load_classes([f"{module}.Recorder", f"{module}:Invariant"]) == [Recorder, Invariant]
    for name, says in [
        ("nosuch_module_xyz.Cls", "ModuleNotFoundError"),
        (f"{module}.Missing", "AttributeError"),
        (f"{module}.step", "is not a logits processor class"),
        ("Recorder", "fully qualified"),
    ]:
        with pytest.raises(LogitsProcessorError, match=says) as info:
            load_classes([name])
        assert isinstance(info.value, SonarError) and name in str(info.value)

"""--logits-processors: the operator's own logits processors, with vLLM v1's interface.

A processor is a class, named on the command line by its fully qualified name (``module.Class``
or ``module:Class``), that the worker builds once, as ``cls(config, device, is_pin_memory)``
(`config` is Sonar's `EngineConfig` where vLLM passes its own config), and that has:

* ``is_argmax_invariant() -> bool``: True when it never changes which token is most likely (it
  is then skipped on steps where every row samples greedily);
* ``update_state(batch_update: BatchUpdate | None)``: called once per sampling step before
  ``apply``, with what changed in the batch's rows since the last step (None: nothing);
* ``apply(logits) -> logits``: the step's logits ``[rows, vocab]`` in, the processed ones out
  (changing them in place and returning them is fine);
* optionally the classmethod ``validate_params(params: SamplingParams)``, which raises
  ValueError for arguments it cannot take: the request is refused with a 400 before it runs.

A request's own arguments are its `SamplingParams.extra_args` (``vllm_xargs`` in an HTTP
request). `BatchUpdate` follows vLLM's meaning: ``added`` lists ``(row, params, prompt token ids,
output token ids)`` for each row that holds a request it did not hold at the last step (the
output list is the request's live list: it grows as tokens are sampled), ``removed`` the rows
left empty, ``batch_size`` the rows of this step. Sonar lays each step's rows out afresh, so a
request that changed rows shows up as added at its new row; ``moved`` is always empty. With
speculative decoding a request has one row per draft position, each added on its own.

A processor that raises fails the step's sampled requests with its error (the worker keeps
serving); it is the operator's code, and the request that set it off cannot be told apart.
"""

from __future__ import annotations

import enum
import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Hashable, Sequence

from sonar.errors import SonarError
from sonar.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


class LogitsProcessorError(SonarError, ValueError):
    """A --logits-processors name that does not import or does not name a logits processor."""


class MoveDirectionality(enum.Enum):
    """vLLM's kinds of row moves; Sonar's batches never move rows (see the module docstring)."""

    UNIDIRECTIONAL = enum.auto()
    SWAP = enum.auto()


@dataclass(frozen=True)
class BatchUpdate:
    batch_size: int
    removed: Sequence[int] = ()
    added: Sequence[tuple[int, SamplingParams, list[int] | None, list[int]]] = ()
    moved: Sequence[tuple[int, int, MoveDirectionality]] = field(default_factory=tuple)


class LogitsProcessor:
    """The interface, as a base class to subclass (any class with these methods will do)."""

    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        pass

    def is_argmax_invariant(self) -> bool:
        raise NotImplementedError

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        raise NotImplementedError

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        """Raise ValueError for `params.extra_args` this processor cannot take."""


_METHODS = ("is_argmax_invariant", "update_state", "apply")


def load_classes(names: Sequence[str]) -> list[type]:
    """The classes `names` name, each checked for the interface's methods."""
    classes = []
    for name in names:
        module_name, sep, attr = name.partition(":") if ":" in name else name.rpartition(".")
        if not sep or not module_name or not attr:
            raise LogitsProcessorError(
                f"--logits-processors {name!r}: give a fully qualified class name (module.Class)"
            )
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except Exception as exc:  # any failure of the operator's module stops the start
            raise LogitsProcessorError(f"--logits-processors {name!r}: {type(exc).__name__}: {exc}") from None
        missing = [m for m in _METHODS if not callable(getattr(cls, m, None))]
        if not isinstance(cls, type) or missing:
            raise LogitsProcessorError(
                f"--logits-processors {name!r} is not a logits processor class (it needs {', '.join(_METHODS)})"
            )
        classes.append(cls)
    return classes


def validate_params(classes: Sequence[type], params: SamplingParams) -> None:
    """Each class's `validate_params`, where it has one (its ValueError refuses the request)."""
    for cls in classes:
        check = getattr(cls, "validate_params", None)
        if callable(check):
            check(params)


class ProcessorChain:
    """The worker's processors and the rows they last saw: turns each step's rows into the
    `BatchUpdate` of what changed, then applies the processors in their command-line order."""

    def __init__(self, processors: Sequence[Any]) -> None:
        self.processors = list(processors)
        self.rows: list[Hashable] = []

    def apply(
        self,
        logits: torch.Tensor,
        keys: Sequence[Hashable],
        params: Sequence[SamplingParams],
        prompts: Sequence[list[int] | None],
        outputs: Sequence[list[int]],
        all_greedy: bool,
    ) -> torch.Tensor:
        """`keys[i]` names what row i holds (a request and its draft position); a row whose key
        changed since the last step is added."""
        added = [
            (i, params[i], prompts[i], outputs[i])
            for i, key in enumerate(keys)
            if i >= len(self.rows) or self.rows[i] != key
        ]
        removed = list(range(len(keys), len(self.rows)))
        update = BatchUpdate(len(keys), removed, added) if added or removed else None
        self.rows = []  # a processor that raises below sees every row as added next time
        for proc in self.processors:
            proc.update_state(update)
        self.rows = list(keys)
        for proc in self.processors:
            if all_greedy and proc.is_argmax_invariant():
                continue
            logits = proc.apply(logits)
        return logits

"""Speculative decoding in the scheduler's core: its settings and the proposers that need no model.

A proposer guesses the next few tokens of a decoding request from the tokens it already has. The
core schedules the request's last token plus the guesses (drafts) in one step; the runner computes
all of them in one forward pass, samples a token at every position, and keeps the drafts up to the
first position where the sampled token differs, plus that token (or one more after the last draft):
one to ``1 + drafts`` tokens per step for the price of one pass over the weights. The KV written
for rejected drafts is overwritten later (the core rolls the request's computed tokens back).

Because a draft from these proposers is one fixed token (not a distribution), "sample every
position as usual and keep the drafts that equal the sample" is exact rejection sampling: a draft
``d`` is kept with probability ``p(d)``, and when it is not, the token drawn instead follows ``p``
without ``d``, renormalised. The output follows the target model's distribution under every
sampling setting, and a seeded request gives the same text with and without speculation (its
noise depends on the output position only, `sonar.models.sampler`).

With a draft model, an EAGLE or EAGLE-3 head or DeepSeek's multi-token-prediction layer
(``draft_model``, ``eagle``, ``eagle3``, ``mtp``: `sonar.engine.drafter`) the worker proposes
instead: each step's result carries the next drafts of the requests it sampled, which the core
schedules with their next step. `SpeculativeConfig` is ``--speculative-config`` validated; the
methods whose heads Sonar does not run (Medusa, MLP speculators) are refused by name.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["NgramProposer", "Proposer", "SpecDecodeStats", "SpeculativeConfig", "make_proposer"]

METHODS = ("ngram", "suffix", "draft_model", "eagle", "eagle3", "mtp")
"""The methods Sonar runs."""

WORKER_METHODS = ("draft_model", "eagle", "eagle3", "mtp")
"""Methods whose drafts the worker makes (`sonar.engine.drafter`)."""

_HEAD_METHODS = ("draft_model", "eagle", "eagle3")
"""Methods that read a draft or head from ``model``; ``mtp`` reads the target's own checkpoint."""

_ALIASES = {"deepseek_mtp": "mtp"}
"""vLLM's older name for DeepSeek's MTP."""

_MODEL_METHODS = ("medusa", "mlp_speculator")

_KEYS = {
    "method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "disable_by_batch_size",
    "suffix_decoding_max_tree_depth",
    "suffix_decoding_max_cached_requests",
    "suffix_decoding_max_spec_factor",
    "suffix_decoding_min_token_prob",
    "model",
    "quantization",
    "revision",
    "draft_tensor_parallel_size",
}


class Proposer(Protocol):
    def propose(self, request_id: str, prompt: Sequence[int], output: Sequence[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` drafts to follow ``prompt + output`` ([] when it has no guess)."""
        ...

    def finish(self, request_id: str) -> None:
        """The request ended: forget what was kept for it."""
        ...


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """``--speculative-config`` (and ``--spec-method`` / ``--spec-tokens``), validated."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    """ngram: the shortest run of trailing tokens that must have occurred before (when only one of
    the two bounds is given, the other equals it)."""
    prompt_lookup_max: int = 5
    """ngram: the longest run, tried first (a longer match predicts better)."""
    disable_by_batch_size: int | None = None
    """No drafts while at least this many requests run (speculation costs compute that a full
    batch uses already)."""
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    model: str | None = None
    """draft_model: the draft model (any model Sonar loads, with the target's tokenizer); eagle,
    eagle3: the head's directory."""
    quantization: str | None = None
    """draft_model: the method its weights are in (None: what its checkpoint says)."""
    revision: str | None = None
    draft_tensor_parallel_size: int | None = None
    """draft_model: the tensor ranks its weights split over, 1 (whole, on the sampler rank) or
    the target's tensor-parallel size (sharded over the target's own ranks); None (unset): the
    target's, as in vLLM (`draft_tp`)."""

    @property
    def lookahead(self) -> int:
        """KV slots a sampling step needs past its own tokens: a draft model writes the KV of the
        token it starts from and of its drafts but the last (`sonar.engine.drafter`)."""
        return self.num_speculative_tokens if self.method in WORKER_METHODS else 0

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> SpeculativeConfig:
        """From the JSON object of ``--speculative-config``; ValueError naming what is wrong."""
        if not isinstance(raw, Mapping):
            raise ValueError(f"--speculative-config must be a JSON object, got {raw!r}")
        method = raw.get("method")
        if method is None and raw.get("model") is not None:
            method = "draft_model"  # a model alone names a draft model, as in vLLM
        method = _ALIASES.get(method, method)
        unknown = sorted(set(raw) - _KEYS)
        if unknown:
            raise ValueError(
                f"--speculative-config: unknown or unsupported key(s) {', '.join(unknown)}; "
                f"Sonar reads {', '.join(sorted(_KEYS))}"
            )
        if method in _MODEL_METHODS:
            raise ValueError(
                f"--speculative-config method {method!r} needs a Medusa or MLP-speculator head, which Sonar does "
                f"not run yet; the methods that work are {', '.join(METHODS)}"
            )
        if method not in METHODS:
            raise ValueError(f"--speculative-config method must be one of {', '.join(METHODS)}, got {method!r}")
        if "num_speculative_tokens" not in raw:
            raise ValueError("--speculative-config needs num_speculative_tokens (or --spec-tokens)")
        values = {key: raw[key] for key in _KEYS if key in raw and raw[key] is not None}
        values["method"] = method
        if method in WORKER_METHODS:
            if method in _HEAD_METHODS and values.get("model") is None:
                raise ValueError(f"--speculative-config method {method} needs a model (--spec-model)")
            if method == "mtp":
                given = sorted(key for key in ("model", "quantization", "revision") if key in values)
                if given:
                    raise ValueError(
                        f"--speculative-config {', '.join(given)}: not for method mtp, which runs the target "
                        "checkpoint's own multi-token-prediction layer"
                    )
            if method != "draft_model" and values.get("draft_tensor_parallel_size", 1) != 1:
                raise ValueError(
                    f"--speculative-config draft_tensor_parallel_size {values['draft_tensor_parallel_size']!r}: "
                    f"the {method} head runs whole on the sampler rank, so only 1 is allowed"
                )
        else:
            given = sorted(key for key in ("model", "quantization", "revision") if key in values)
            if given:
                raise ValueError(
                    f"--speculative-config {', '.join(given)}: only for methods {', '.join(_HEAD_METHODS)}, "
                    f"not {method}"
                )
            if values.get("draft_tensor_parallel_size", 1) != 1:
                raise ValueError(
                    f"--speculative-config draft_tensor_parallel_size {values['draft_tensor_parallel_size']!r}: "
                    f"method {method} runs no model, so only 1 is allowed"
                )
        if "prompt_lookup_min" not in values and "prompt_lookup_max" not in values:
            values["prompt_lookup_min"] = values["prompt_lookup_max"] = 5
        else:  # one given: the other is the same
            values.setdefault("prompt_lookup_min", values.get("prompt_lookup_max"))
            values.setdefault("prompt_lookup_max", values.get("prompt_lookup_min"))
        config = cls(**values)
        config.check()
        return config

    def draft_tp(self, target_tp: int, stages: int) -> int:
        """The tensor ranks the draft model splits over, for a target on `target_tp` tensor ranks
        and `stages` pipeline stages (ValueError naming a size that cannot be): 1 for every method
        but ``draft_model``. A draft split over the ranks runs on all of them, each step beside
        the target; only a one-stage group has its sampled tokens on every tensor rank, so with
        several stages the draft runs whole on the sampler (unset: 1)."""
        if self.method != "draft_model":
            return 1
        size = self.draft_tensor_parallel_size
        if size is None:
            return target_tp if stages == 1 else 1
        if size not in (1, target_tp):
            raise ValueError(
                f"--speculative-config draft_tensor_parallel_size {size} is not allowed: it must be 1 (the draft "
                f"whole on one rank) or the target's --tensor-parallel-size {target_tp} (split over the same ranks)"
            )
        if size > 1 and stages > 1:
            raise ValueError(
                f"--speculative-config draft_tensor_parallel_size {size} with --pipeline-parallel-size {stages} is "
                "not supported: the draft runs whole on the sampler rank there, so it must be 1"
            )
        return size

    def check(self) -> None:
        def positive_int(name: str, value: Any) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--speculative-config {name} must be a positive integer, got {value!r}")

        positive_int("num_speculative_tokens", self.num_speculative_tokens)
        if self.num_speculative_tokens > 64:
            raise ValueError(
                f"--speculative-config num_speculative_tokens must be at most 64, got {self.num_speculative_tokens}"
            )
        positive_int("prompt_lookup_min", self.prompt_lookup_min)
        positive_int("prompt_lookup_max", self.prompt_lookup_max)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"--speculative-config prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if self.disable_by_batch_size is not None:
            positive_int("disable_by_batch_size", self.disable_by_batch_size)
        if self.draft_tensor_parallel_size is not None:
            positive_int("draft_tensor_parallel_size", self.draft_tensor_parallel_size)
        positive_int("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth)
        if (
            isinstance(self.suffix_decoding_max_cached_requests, bool)
            or not isinstance(self.suffix_decoding_max_cached_requests, int)
            or self.suffix_decoding_max_cached_requests < 0
        ):
            raise ValueError(
                "--speculative-config suffix_decoding_max_cached_requests must be an integer >= 0, "
                f"got {self.suffix_decoding_max_cached_requests!r}"
            )
        if not self.suffix_decoding_max_spec_factor > 0:
            raise ValueError(
                "--speculative-config suffix_decoding_max_spec_factor must be positive, "
                f"got {self.suffix_decoding_max_spec_factor!r}"
            )
        if not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ValueError(
                "--speculative-config suffix_decoding_min_token_prob must be in [0, 1], "
                f"got {self.suffix_decoding_min_token_prob!r}"
            )


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the request's last ``n`` tokens
    (``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``) and propose what followed it.

    The tokens of each request are kept as an int32 array that only grows (one append per new
    token), searched with ``bytes.rfind``: a search is a C loop over the context, not Python."""

    def __init__(self, num_tokens: int, min_n: int, max_n: int) -> None:
        self.num_tokens = num_tokens
        self.min_n = min_n
        self.max_n = max_n
        self._tokens: dict[str, array] = {}

    def propose(self, request_id: str, prompt: Sequence[int], output: Sequence[int], max_tokens: int) -> list[int]:
        tokens = self._tokens.get(request_id)
        if tokens is None or len(tokens) > len(prompt) + len(output):
            tokens = self._tokens[request_id] = array("i", prompt)
        have = len(tokens)
        if have < len(prompt):
            tokens.extend(prompt[have:])
            have = len(tokens)
        tokens.extend(output[have - len(prompt) :])
        want = min(max_tokens, self.num_tokens)
        total = len(tokens)
        if want <= 0 or total < self.min_n + 1:
            return []
        data = tokens.tobytes()
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            pattern = data[-4 * n :]
            end = 4 * (total - 1)  # the match must end before the last token: something follows it
            while True:
                at = data.rfind(pattern, 0, end)
                if at < 0:
                    break
                if at % 4 == 0:  # a match at a token boundary, not inside one
                    first = at // 4 + n
                    return tokens[first : first + want].tolist()
                end = at + len(pattern) - 1
        return []

    def finish(self, request_id: str) -> None:
        self._tokens.pop(request_id, None)


def make_proposer(config: SpeculativeConfig) -> Proposer | None:
    """The core's proposer; None for a draft model, whose drafts come back with each step."""
    if config.method in WORKER_METHODS:
        return None
    if config.method == "ngram":
        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
    from sonar.core.suffix import SuffixProposer

    return SuffixProposer(
        max_tree_depth=config.suffix_decoding_max_tree_depth,
        max_cached_requests=config.suffix_decoding_max_cached_requests,
        max_spec_factor=config.suffix_decoding_max_spec_factor,
        min_token_prob=config.suffix_decoding_min_token_prob,
    )


@dataclass(slots=True)
class SpecDecodeStats:
    """Counters since start (``sonar:spec_decode_*``)."""

    num_drafts: int = 0
    """Steps of a request that carried drafts."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] | None = None
    """``[i]``: drafts accepted at position ``i`` (0-based) of their step."""

    def record(self, proposed: int, accepted: int, positions: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        if self.accepted_per_position is None:
            self.accepted_per_position = [0] * positions
        for i in range(accepted):
            self.accepted_per_position[i] += 1

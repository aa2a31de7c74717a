"""`SamplingParams`: how one request wants its tokens chosen and its text shaped.

The struct travels between processes (frontend → scheduler → worker / detokenizer), so it is a
`msgspec.Struct`. Its defaults follow vLLM, so a vLLM user gets what they expect: 16 tokens,
temperature 1, no truncation, special tokens skipped.

Checks happen in two places:

* construction (`__post_init__`, which also runs when msgspec decodes the struct) rejects values
  that are wrong for any model: a negative temperature, `top_p` outside (0, 1], `n < 1`, ...
  It also normalises a little: a single stop string becomes a one-element list, `top_k=-1`
  becomes 0 (both mean "off").
* `validate(max_logprobs=..., vocab_size=...)` checks the limits that depend on the engine,
  which only the frontend/scheduler know. (Prompt length + `max_tokens` against the context
  length needs the prompt, so the frontend checks that.)
* `check_token_left(vocab_size=..., eos_token_ids=...)` refuses params that leave the sampler no
  token to draw (`min_tokens` with stop ids covering the vocabulary); the client runs it beside
  `validate`, where the model's EOS ids are known.

Both raise `SamplingParamsError`, a `ValueError` whose `param` names the offending field, so the
HTTP layer can turn it into a 400 that says which parameter was wrong.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import msgspec

from sonar.errors import SonarError

#: Temperatures below this are treated as greedy (argmax) sampling.
GREEDY_EPS = 1e-5

#: OpenAI's documented range for `logit_bias` values.
MAX_LOGIT_BIAS = 100.0


def over_limit(what: str, limit: int, got: int, name: str) -> str:
    """The message of a request over one of the engine's limits: the limit, its engine argument
    and its `serve` flag, and what the request asked for."""
    flag = "--" + name.replace("_", "-")
    return f"at most {limit} {what} per request ({name}, {flag}), got {got}"


class SamplingParamsError(SonarError, ValueError):
    """A sampling parameter is out of range; `param` is the field's name."""

    status = 400

    def __init__(self, param: str, message: str) -> None:
        self.param = param
        super().__init__(f"{param}: {message}")


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
"""The constraint forms of `StructuredOutputsParams`; a request sets exactly one."""


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A constraint on what a request may generate (vLLM's `StructuredOutputsParams`).

    Exactly one form is set: `json` (a JSON schema, as an object or its JSON text),
    `json_object` (any JSON object), `regex`, `choice` (one of these strings), `grammar` (EBNF for
    xgrammar, or Lark for llguidance) or `structural_tag` (xgrammar's structural tag, as JSON
    text). `backend` overrides the server's `--structured-outputs-config.backend` for this
    request (the legacy `guided_decoding_backend`).
    """

    json: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    backend: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        set_forms = [kind for kind in STRUCTURED_KINDS if getattr(self, kind) not in (None, False)]
        if len(set_forms) != 1:
            raise SamplingParamsError(
                "structured_outputs",
                f"set exactly one of {', '.join(STRUCTURED_KINDS)}; got {', '.join(set_forms) or 'none'}",
            )
        if self.choice is not None and not self.choice:
            raise SamplingParamsError("structured_outputs", "choice must list at least one string")

    @property
    def kind(self) -> str:
        """Which form is set ("json", "regex", ...)."""
        return next(kind for kind in STRUCTURED_KINDS if getattr(self, kind) not in (None, False))


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Per-request sampling and output options (the public `sonar.SamplingParams`).

    Penalties follow vLLM / OpenAI: `repetition_penalty` looks at prompt and output tokens
    (divides positive logits, multiplies negative ones); `presence_penalty` and
    `frequency_penalty` look at output tokens only and are subtracted from the logits.
    """

    n: int = 1
    #: Tokens to generate at most; None means up to the model's context length.
    max_tokens: int | None = 16
    #: EOS and `stop_token_ids` are blocked (and stop strings ignored) until this many tokens.
    min_tokens: int = 0
    #: 0 means greedy.
    temperature: float = 1.0
    top_p: float = 1.0
    #: 0 (or -1, normalised to 0) disables top-k.
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    #: Token id → value added to that token's logit before sampling.
    logit_bias: dict[int, float] | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    #: Same seed, same prompt and same logits give the same tokens, alone or in any batch.
    seed: int | None = None
    #: None: no logprobs; N: the sampled token's logprob plus the top N.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    #: Kept for vLLM compatibility. Fast (Rust) tokenizers decode special tokens without added
    #: spaces whatever this says, as vLLM does with them.
    spaces_between_special_tokens: bool = True
    #: Constrain the output to a JSON schema, regex, choice or grammar (None: free text).
    structured_outputs: StructuredOutputsParams | None = None
    #: Arguments for the server's logits processors (vLLM's `extra_args`; `vllm_xargs` over HTTP):
    #: only a server started with --logits-processors takes them (`sonar.engine.logits_processors`).
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):  # the same keys, as a plain mapping
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as exc:
                raise SamplingParamsError("structured_outputs", str(exc)) from None
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise SamplingParamsError(
                "structured_outputs",
                f"must be a StructuredOutputsParams or a dict of its fields, got {type(self.structured_outputs).__name__}",
            )
        self._check()

    def _check(self) -> None:
        if self.n < 1:
            raise SamplingParamsError("n", f"must be at least 1, got {self.n}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise SamplingParamsError("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise SamplingParamsError("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError(
                "min_tokens",
                f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
            )
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise SamplingParamsError("temperature", f"must be a finite number >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise SamplingParamsError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SamplingParamsError("top_k", f"must be -1 or 0 (off) or a positive number, got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise SamplingParamsError("min_p", f"must be in [0, 1], got {self.min_p}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise SamplingParamsError(
                "repetition_penalty", f"must be a finite number > 0, got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (-2.0 <= value <= 2.0):
                raise SamplingParamsError(name, f"must be in [-2, 2], got {value}")
        if self.logit_bias:
            for token_id, bias in self.logit_bias.items():
                if token_id < 0:
                    raise SamplingParamsError("logit_bias", f"token ids must be >= 0, got {token_id}")
                if not (-MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                    raise SamplingParamsError(
                        "logit_bias",
                        f"values must be in [-100, 100], got {bias} for token {token_id}",
                    )
        if self.stop is not None and any(not s for s in self.stop):
            raise SamplingParamsError("stop", "stop strings must not be empty")
        if self.stop_token_ids is not None and any(t < 0 for t in self.stop_token_ids):
            raise SamplingParamsError("stop_token_ids", f"token ids must be >= 0, got {self.stop_token_ids}")
        if self.logprobs is not None and self.logprobs < 0:
            raise SamplingParamsError("logprobs", f"must be >= 0, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise SamplingParamsError("prompt_logprobs", f"must be >= 0, got {self.prompt_logprobs}")

    def validate(
        self,
        *,
        max_logprobs: int = 20,
        vocab_size: int | None = None,
        max_stop_strings: int | None = None,
        max_stop_string_chars: int | None = None,
        max_stop_token_ids: int | None = None,
        max_logit_bias: int | None = None,
    ) -> None:
        """Check the limits that depend on the engine; raise `SamplingParamsError` if one fails.

        Run this in the frontend before a request is admitted: the sampler trusts the params it
        is given (an out-of-vocabulary `logit_bias` id there would fail the whole batch). The
        `max_*` counts are the engine's request limits (None: no cap); their errors name the
        limit and its `serve` flag. `max_logprobs=-1` (`--max-logprobs -1`) sets no cap but the
        vocabulary's size.
        """
        self._check()
        self._check_counts(max_stop_strings, max_stop_string_chars, max_stop_token_ids, max_logit_bias)
        cap, what = (max_logprobs, "") if max_logprobs >= 0 else (vocab_size, " (the vocabulary size)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and cap is not None and value > cap:
                raise SamplingParamsError(name, f"must be <= {cap}{what}, got {value}")
        if vocab_size is not None:
            if self.logit_bias:
                bad = [t for t in self.logit_bias if t >= vocab_size]
                if bad:
                    raise SamplingParamsError("logit_bias", f"token ids must be < vocab size {vocab_size}, got {bad}")
            if self.stop_token_ids:
                bad = [t for t in self.stop_token_ids if t >= vocab_size]
                if bad:
                    raise SamplingParamsError(
                        "stop_token_ids",
                        f"token ids must be < vocab size {vocab_size}, got {bad}",
                    )

    def _check_counts(
        self,
        max_stop_strings: int | None,
        max_stop_string_chars: int | None,
        max_stop_token_ids: int | None,
        max_logit_bias: int | None,
    ) -> None:
        stops = self.stop_strings
        if max_stop_strings is not None and len(stops) > max_stop_strings:
            raise SamplingParamsError(
                "stop", over_limit("stop strings", max_stop_strings, len(stops), "max_stop_strings")
            )
        longest = max(stops, key=len, default="")
        if max_stop_string_chars is not None and len(longest) > max_stop_string_chars:
            raise SamplingParamsError(
                "stop",
                over_limit("characters per stop string", max_stop_string_chars, len(longest), "max_stop_string_chars"),
            )
        ids = self.stop_token_ids or ()
        if max_stop_token_ids is not None and len(ids) > max_stop_token_ids:
            raise SamplingParamsError(
                "stop_token_ids", over_limit("stop token ids", max_stop_token_ids, len(ids), "max_stop_token_ids")
            )
        bias = self.logit_bias or {}
        if max_logit_bias is not None and len(bias) > max_logit_bias:
            raise SamplingParamsError(
                "logit_bias", over_limit("logit_bias entries", max_logit_bias, len(bias), "max_logit_bias")
            )

    def check_token_left(self, *, vocab_size: int, eos_token_ids: Iterable[int] = ()) -> None:
        """Raise `SamplingParamsError` when these params leave no token to sample at some step.

        The sampler sets to -inf, while fewer than `min_tokens` tokens are out, every id of
        `stop_token_ids` and (unless `ignore_eos`) the model's EOS ids: when those cover the whole
        vocabulary, the first step has nothing to draw from. (`logit_bias` only shifts logits, by at
        most 100, and masks nothing.) The client runs this with `validate`, where the EOS ids are
        known.
        """
        if self.min_tokens < 1 or not self.stop_token_ids:
            return
        eos = [] if self.ignore_eos else list(eos_token_ids)
        if len(self.stop_token_ids) + len(eos) < vocab_size:
            return
        blocked = {t for t in (*self.stop_token_ids, *eos) if 0 <= t < vocab_size}
        if len(blocked) >= vocab_size:
            raise SamplingParamsError(
                "stop_token_ids",
                f"with min_tokens={self.min_tokens} these ids{'' if self.ignore_eos else ' and the EOS ids'} "
                f"are blocked until {self.min_tokens} token(s) are out, and they cover the whole vocabulary of "
                f"{vocab_size} tokens: no token is left to generate",
            )

    @property
    def greedy(self) -> bool:
        """True when this request takes the most likely token (temperature ~ 0)."""
        return self.temperature < GREEDY_EPS

    @property
    def stop_strings(self) -> list[str]:
        """The stop strings as a list (empty when there are none)."""
        return list(self.stop) if self.stop else []

    def for_child(self, index: int) -> "SamplingParams":
        """The params of the `index`-th of the `n` sequences of a request.

        Each child samples once (`n=1`); a seeded request gives child `i` the seed `seed + i`,
        so the children differ from each other but each is reproducible (as vLLM does).
        """
        seed = None if self.seed is None else self.seed + index
        return msgspec.structs.replace(self, n=1, seed=seed)

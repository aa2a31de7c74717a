"""The two grammar backends: xgrammar and llguidance ("guidance"), behind one shape.

A request's `StructuredOutputsParams` becomes a `GrammarSpec` (its canonical form: the cache key),
which a backend compiles into a `CompiledGrammar`; each request then gets its own matcher from it
(`CompiledGrammar.matcher`, the core's `GrammarMatcher`). What each backend cannot express raises
`Unsupported` (``auto`` then tries the other one); a spec that does not compile raises
`GrammarError` with the backend's message.

| form | xgrammar | guidance |
|---|---|---|
| json (schema) | `compile_json_schema` (strict mode: ``additionalProperties`` left out means false) | JSON schema grammar; ``disable_additional_properties`` adds ``additionalProperties: false`` |
| json_object | schema ``{"type": "object"}`` | the same |
| regex | `compile_regex` | regex grammar |
| choice | EBNF alternatives of the quoted strings | Lark alternatives |
| grammar | EBNF (GBNF-like) | Lark |
| structural_tag | `compile_structural_tag` | refused |
| whitespace_pattern | refused | ``x-guidance.whitespace_pattern`` |
| a string's pattern with min/maxLength | refused (xgrammar would drop the lengths) | honoured |
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from typing import Any

from sonar.core.grammar import GrammarMatcher
from sonar.core.thinking import ThinkingGate
from sonar.errors import SonarError
from sonar.sampling_params import StructuredOutputsParams

_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class GrammarError(SonarError, ValueError):
    """A spec does not compile; the message is the backend's (the compiler raises it to the
    caller as an `InvalidRequestError` naming ``structured_outputs``)."""

    status = 400


class Unsupported(GrammarError):
    """The backend cannot express this spec (another one may)."""


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A structured output constraint in canonical form (the compile cache's key, with the
    backend and the tokenizer)."""

    kind: str
    text: str
    """The schema as JSON (its keys in their order: xgrammar generates properties in it), the regex, the choices as a JSON list, the grammar,
    or the structural tag's JSON."""
    any_whitespace: bool = True
    strict_properties: bool = False
    whitespace_pattern: str | None = None

    @classmethod
    def of(
        cls,
        params: StructuredOutputsParams,
        *,
        disable_any_whitespace: bool = False,
        disable_additional_properties: bool = False,
    ) -> "GrammarSpec":
        """The spec of a request's params, under the server's defaults (a request may tighten,
        never loosen them). Raises `GrammarError` for a schema that is not JSON."""
        kind = params.kind
        if kind == "json":
            schema = params.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as exc:
                    raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise GrammarError(f"a JSON schema is an object, got {type(schema).__name__}")
            text = json.dumps(schema, ensure_ascii=False)  # property order is generation order
        elif kind == "json_object":
            text = '{"type": "object"}'
        elif kind == "choice":
            text = json.dumps(params.choice, ensure_ascii=False)
        else:
            text = getattr(params, kind)
        return cls(
            kind,
            text,
            any_whitespace=not (disable_any_whitespace or params.disable_any_whitespace),
            strict_properties=disable_additional_properties or params.disable_additional_properties,
            whitespace_pattern=params.whitespace_pattern,
        )

    @property
    def size(self) -> int:
        """Characters of the spec (what the size limit counts)."""
        return len(self.text) + len(self.whitespace_pattern or "")


class CompiledGrammar:
    """A grammar ready to match: one compile, a matcher per request."""

    backend: str

    def matcher(self) -> GrammarMatcher:
        raise NotImplementedError


def _choice_alternatives(spec: GrammarSpec) -> str:
    return " | ".join(json.dumps(choice, ensure_ascii=False) for choice in json.loads(spec.text))


# -- xgrammar ---------------------------------------------------------------------------------------
class _XgrMatcher:
    __slots__ = ("_m",)

    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def accept_token(self, token_id: int) -> bool:
        return self._m.accept_token(token_id)

    def is_terminated(self) -> bool:
        return self._m.is_terminated()

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def valid_prefix(self, tokens: list[int]) -> int:
        n = 0
        for token in tokens:  # a token xgrammar refuses leaves its state as it was
            if self._m.is_terminated() or not self._m.accept_token(token):
                break
            n += 1
        if n:
            self._m.rollback(n)
        return n

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._m.rollback(num_tokens)


def fill_bitmasks(matchers: list[GrammarMatcher | None], bitmask: Any) -> None:
    """Fill row ``i`` of `bitmask` from ``matchers[i]`` (None, or a request still thinking: every
    token allowed; a `ThinkingGate` at an undecided first token adds its opening tokens).
    xgrammar's rows are filled together on its thread pool; the others one by one."""
    batch, rows, extra = [], [], []
    for i, matcher in enumerate(matchers):
        if isinstance(matcher, ThinkingGate):
            if matcher.also_allowed is not None:
                extra.append((i, matcher.also_allowed))
            matcher = matcher.constraint
        if matcher is None:
            bitmask[i].fill_(-1)
        elif isinstance(matcher, _XgrMatcher):
            batch.append(matcher._m)
            rows.append(i)
        else:
            matcher.fill_bitmask(bitmask, i)
    if len(batch) == 1:
        batch[0].fill_next_token_bitmask(bitmask, rows[0])
    elif batch:
        _batch_matcher().batch_fill_next_token_bitmask(batch, bitmask, rows)
    for i, allowed in extra:
        bitmask[i] |= allowed


def fill_draft_bitmasks(matcher: GrammarMatcher, drafts: list[int], bitmask: Any, row: int) -> None:
    """Rows ``row .. row + len(drafts)`` of `bitmask`: the tokens `matcher` allows after each prefix
    of `drafts` (all of them allowed: `GrammarMatcher.valid_prefix` cut them), its state restored."""
    for j in range(len(drafts) + 1):
        fill_bitmasks([matcher], bitmask[row + j : row + j + 1])
        if j < len(drafts):
            matcher.accept_token(drafts[j])
    matcher.rollback(len(drafts))


_BATCH: list[Any] = []


def _batch_matcher() -> Any:
    if not _BATCH:
        import xgrammar

        _BATCH.append(xgrammar.BatchGrammarMatcher(max_threads="auto"))
    return _BATCH[0]


class XgrammarGrammar(CompiledGrammar):
    backend = "xgrammar"

    def __init__(self, compiled: Any) -> None:
        self.compiled = compiled

    def matcher(self) -> GrammarMatcher:
        import xgrammar

        return _XgrMatcher(xgrammar.GrammarMatcher(self.compiled))


class XgrammarBackend:
    """xgrammar's compiler over one tokenizer (it keeps its own cache too)."""

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        import xgrammar

        self.info = info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=eos_token_ids or None
        )
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        if spec.whitespace_pattern is not None:
            raise Unsupported("xgrammar does not take a whitespace_pattern (the guidance backend does)")
        c = self._compiler
        if spec.kind == "json":
            problem = _xgrammar_cannot(json.loads(spec.text))
            if problem:
                raise Unsupported(f"xgrammar ignores {problem} (the guidance backend honours it)")
        try:
            if spec.kind in ("json", "json_object"):
                compiled = c.compile_json_schema(
                    spec.text, any_whitespace=spec.any_whitespace, strict_mode=spec.kind == "json"
                )
            elif spec.kind == "regex":
                compiled = c.compile_regex(spec.text)
            elif spec.kind == "choice":
                compiled = c.compile_grammar("root ::= " + _choice_alternatives(spec))
            elif spec.kind == "grammar":
                compiled = c.compile_grammar(spec.text)
            else:
                compiled = c.compile_structural_tag(_structural_tag(spec.text))
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarError(_XGR_PREFIX.sub("", str(exc)).strip()) from None
        return XgrammarGrammar(compiled)


def _xgrammar_cannot(schema: Any) -> str | None:
    """A JSON schema feature xgrammar would drop with only a warning, or None."""
    if isinstance(schema, list):
        return next((p for p in map(_xgrammar_cannot, schema) if p), None)
    if not isinstance(schema, dict):
        return None
    if "pattern" in schema and ("minLength" in schema or "maxLength" in schema):
        return "minLength/maxLength next to a pattern"
    return next((p for p in map(_xgrammar_cannot, schema.values()) if p), None)


def _structural_tag(text: str) -> Any:
    """xgrammar's structural tag from its JSON: the current form (``{"type": "structural_tag",
    ...}``) as is, vLLM's older ``{"structures": [{"begin", "schema", "end"}], "triggers"}``
    converted."""
    import xgrammar

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"structural_tag is not valid JSON: {exc}") from None
    if isinstance(value, dict) and "structures" in value:
        try:
            items = [
                xgrammar.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                for s in value["structures"]
            ]
            return xgrammar.StructuralTag.from_legacy_structural_tag(items, list(value["triggers"]))
        except (KeyError, TypeError) as exc:
            raise GrammarError(f"structural_tag: structures need begin, schema and end, and triggers: {exc}") from None
    return text


# -- llguidance -------------------------------------------------------------------------------------
class _GuidanceMatcher:
    __slots__ = ("_m", "_fill")

    def __init__(self, matcher: Any) -> None:
        from llguidance.torch import fill_next_token_bitmask

        self._m = matcher
        self._fill = fill_next_token_bitmask

    def accept_token(self, token_id: int) -> bool:
        return self._m.consume_token(token_id)

    def is_terminated(self) -> bool:
        return self._m.is_stopped()

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        self._fill(self._m, bitmask, row)

    def valid_prefix(self, tokens: list[int]) -> int:
        return self._m.validate_tokens(tokens)  # without consuming them

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._m.rollback(num_tokens)


class GuidanceGrammar(CompiledGrammar):
    backend = "guidance"

    def __init__(self, tokenizer: Any, grammar: str) -> None:
        self.tokenizer = tokenizer
        self.grammar = grammar

    def matcher(self) -> GrammarMatcher:
        import llguidance

        return _GuidanceMatcher(llguidance.LLMatcher(self.tokenizer, self.grammar))


class GuidanceBackend:
    """llguidance over one tokenizer."""

    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        import llguidance.hf

        # llguidance takes one stop token: the model's first EOS (the tokenizer's own when none)
        eos = eos_token_ids[0] if eos_token_ids else None
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        from llguidance import LLMatcher

        if spec.kind not in ("json", "json_object") and spec.whitespace_pattern is not None:
            raise Unsupported("whitespace_pattern applies to JSON schemas only")
        try:
            grammar = self._grammar(spec)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise GrammarError(str(exc)) from None
        failed, messages = LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer)
        if failed:
            raise GrammarError("; ".join(messages).strip())
        return GuidanceGrammar(self._tokenizer, grammar)

    @staticmethod
    def _grammar(spec: GrammarSpec) -> str:
        from llguidance import LLMatcher

        if spec.kind in ("json", "json_object"):
            schema = json.loads(spec.text)
            if spec.strict_properties:
                schema = _no_additional_properties(schema)
            options: dict[str, Any] = {"whitespace_flexible": spec.any_whitespace}
            if spec.whitespace_pattern is not None:
                options["whitespace_pattern"] = spec.whitespace_pattern
            grammar = LLMatcher.grammar_from_json_schema(schema, defaults=options)
        elif spec.kind == "regex":
            grammar = LLMatcher.grammar_from_regex(spec.text)
        elif spec.kind == "choice":
            grammar = LLMatcher.grammar_from_lark("start: " + _choice_alternatives(spec))
        elif spec.kind == "grammar":
            grammar = LLMatcher.grammar_from_lark(spec.text)
        else:
            raise Unsupported("the guidance backend does not take a structural_tag (xgrammar does)")
        return grammar


def _no_additional_properties(schema: Any) -> Any:
    """The schema with ``additionalProperties: false`` on every object that does not say."""
    if isinstance(schema, list):
        return [_no_additional_properties(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _no_additional_properties(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


class Backends:
    """Both backends over one tokenizer, each built on first use (xgrammar reads the whole
    vocabulary: ~0.2 s for 49k tokens)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._args = (tokenizer, vocab_size, eos_token_ids)
        self._built: dict[str, Any] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> XgrammarBackend | GuidanceBackend:
        with self._lock:
            backend = self._built.get(name)
            if backend is None:
                cls = XgrammarBackend if name == "xgrammar" else GuidanceBackend
                backend = self._built[name] = cls(*self._args)
            return backend


def compile_spec(backends: Backends, backend: str, spec: GrammarSpec) -> CompiledGrammar:
    """Compile `spec` with `backend` (``auto``: xgrammar, then guidance where xgrammar fails)."""
    if backend != "auto":
        return backends.get(backend).compile(spec)
    try:
        return backends.get("xgrammar").compile(spec)
    except GrammarError as first:
        try:
            return backends.get("guidance").compile(spec)
        except Unsupported:
            raise first from None
        except GrammarError as second:
            if isinstance(first, Unsupported):
                raise second from None
            raise GrammarError(f"xgrammar: {first}; guidance: {second}") from None

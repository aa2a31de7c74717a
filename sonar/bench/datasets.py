"""Benchmark datasets: what to send, how long each prompt is and how many tokens to ask for.

* ``random``: prompts of token ids drawn uniformly from the tokenizer's vocabulary (special
  tokens left out), decoded to text; input and output lengths drawn uniformly within
  ``len * (1 ± range_ratio)``.
* ``prefix-repetition``: ``num_prefixes`` random prefixes, each shared by
  ``num_prompts / num_prefixes`` prompts that differ in a random suffix (exercises the prefix cache).
* ``json-schema``: each request asks for JSON under a JSON schema (sent as ``response_format``):
  see `sonar.bench.json_schemas` for the schemas and their options.
* ``edit``: outputs that repeat the input, where speculative decoding pays: each prompt asks to
  rewrite a generated passage (English prose, or Python code) with one word changed, and asks for
  about as many tokens as the passage has (``--edit-input-len`` tokens of passage; the output
  length is the passage's, unless ``--edit-output-len`` is given).
* ``sharegpt``: a local JSON file in the ShareGPT format (a list of ``{"conversations": [{"from":
  "human", "value": ...}, {"from": "gpt", "value": ...}, ...]}``); the first human turn is the
  prompt and the reply's token count the output length, unless an output length is given.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sonar.bench.json_schemas import schema_request

DATASETS = ("random", "prefix-repetition", "json-schema", "sharegpt", "edit")


@dataclass
class SampleRequest:
    """One request of a benchmark: its prompt text, its length in tokens and the tokens to generate."""

    prompt: str
    prompt_len: int
    expected_output_len: int
    #: The JSON schema the output must follow (None: free text).
    json_schema: dict[str, Any] | None = None


@dataclass
class DatasetArgs:
    """The dataset flags shared by `bench serve`, `bench throughput` and `bench sweep`."""

    dataset_name: str = "random"
    dataset_path: str | None = None
    num_prompts: int = 1000
    seed: int = 0
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    prefix_repetition_prefix_len: int = 256
    prefix_repetition_suffix_len: int = 256
    prefix_repetition_num_prefixes: int = 10
    prefix_repetition_output_len: int = 128
    sharegpt_output_len: int | None = None
    json_schema_output_len: int = 128
    json_schema_unique: bool = False
    json_schema_min_chars: int = 0
    json_schema_off: bool = False
    edit_input_len: int = 256
    edit_output_len: int | None = None


def add_dataset_arguments(parser: Any) -> None:
    """Add the dataset flags (named as `vllm bench serve` names them) to an argparse parser."""
    g = parser.add_argument_group("dataset")
    g.add_argument("--dataset-name", choices=DATASETS, default="random", help="which dataset to draw prompts from")
    g.add_argument("--dataset-path", default=None, help="the ShareGPT JSON file (for --dataset-name sharegpt)")
    g.add_argument("--num-prompts", type=int, default=1000, help="how many requests to send")
    g.add_argument("--seed", type=int, default=0, help="seed for the prompts and the arrival times")
    g.add_argument("--random-input-len", type=int, default=1024, help="random: prompt tokens")
    g.add_argument("--random-output-len", type=int, default=128, help="random: tokens to generate")
    g.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="random: lengths drawn uniformly in [len*(1-r), len*(1+r)]",
    )
    g.add_argument(
        "--random-prefix-len", type=int, default=0, help="random: tokens of one fixed prefix put before every prompt"
    )
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=256, help="prefix-repetition: prefix tokens")
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=256, help="prefix-repetition: suffix tokens")
    g.add_argument(
        "--prefix-repetition-num-prefixes", type=int, default=10, help="prefix-repetition: distinct prefixes"
    )
    g.add_argument(
        "--prefix-repetition-output-len", type=int, default=128, help="prefix-repetition: tokens to generate"
    )
    g.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="sharegpt: tokens to generate (default: the length of the recorded reply)",
    )

    g.add_argument("--json-schema-output-len", type=int, default=128, help="json-schema: max tokens per request")
    g.add_argument(
        "--json-schema-unique", action="store_true", help="json-schema: a distinct schema per request (cold compiles)"
    )
    g.add_argument(
        "--json-schema-min-chars",
        type=int,
        default=0,
        help="json-schema: a first free-text property of at least this many characters (runs to max tokens)",
    )
    g.add_argument(
        "--json-schema-off", action="store_true", help="json-schema: the same prompts and lengths, no schema sent"
    )
    g.add_argument("--edit-input-len", type=int, default=256, help="edit: tokens of the passage to rewrite")
    g.add_argument(
        "--edit-output-len",
        type=int,
        default=None,
        help="edit: tokens to generate (default: as many as the passage has)",
    )


def dataset_args(ns: Any) -> DatasetArgs:
    """The `DatasetArgs` of a parsed argparse namespace."""
    fields = DatasetArgs.__dataclass_fields__
    return DatasetArgs(**{k: getattr(ns, k) for k in fields if hasattr(ns, k)})


def sample_requests(args: DatasetArgs, tokenizer: Any) -> list[SampleRequest]:
    """The benchmark's requests for `args`, drawn deterministically from `args.seed`."""
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be at least 1")
    if args.dataset_name == "random":
        return _random(args, tokenizer)
    if args.dataset_name == "prefix-repetition":
        return _prefix_repetition(args, tokenizer)
    if args.dataset_name == "json-schema":
        return _json_schema(args, tokenizer)
    if args.dataset_name == "sharegpt":
        return _sharegpt(args, tokenizer)
    if args.dataset_name == "edit":
        return _edit(args, tokenizer)
    raise ValueError(f"unknown dataset {args.dataset_name!r} (expected one of {', '.join(DATASETS)})")


def _allowed_ids(tokenizer: Any) -> np.ndarray:
    """Token ids a random prompt may use: the whole vocabulary but the special tokens."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    vocab = len(tokenizer)
    return np.array([i for i in range(vocab) if i not in special], dtype=np.int64)


def _text_of(
    tokenizer: Any, ids: np.ndarray, rng: np.random.Generator | None = None, allowed: np.ndarray | None = None
) -> tuple[str, int]:
    """Decode random ids to text; (the text, its length in tokens when encoded again).

    Decoding and re-encoding random ids merges or splits some tokens; with `rng` and `allowed`
    the text is adjusted (truncated, or extended with more random ids) a few times so that it
    encodes to as many tokens as `ids` had."""
    target = len(ids)
    tokens = ids.tolist()
    for _ in range(8):
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) == target or rng is None or allowed is None:
            return text, len(encoded)
        if len(encoded) > target:
            tokens = encoded[:target]
        else:
            tokens = encoded + rng.choice(allowed, size=target - len(encoded)).tolist()
    return text, len(encoded)


def _lengths(rng: np.random.Generator, mean: int, ratio: float, n: int, minimum: int) -> np.ndarray:
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio}")
    low = max(minimum, int(mean * (1 - ratio)))
    high = max(low, int(mean * (1 + ratio)))
    return rng.integers(low, high + 1, size=n)


def _random(args: DatasetArgs, tokenizer: Any) -> list[SampleRequest]:
    rng = np.random.default_rng(args.seed)
    ids = _allowed_ids(tokenizer)
    in_lens = _lengths(rng, args.random_input_len, args.random_range_ratio, args.num_prompts, 1)
    out_lens = _lengths(rng, args.random_output_len, args.random_range_ratio, args.num_prompts, 1)
    prefix = rng.choice(ids, size=args.random_prefix_len) if args.random_prefix_len else np.array([], np.int64)
    out = []
    for n_in, n_out in zip(in_lens, out_lens):
        tokens = np.concatenate([prefix, rng.choice(ids, size=int(n_in))])
        text, length = _text_of(tokenizer, tokens, rng, ids)
        out.append(SampleRequest(text, length, int(n_out)))
    return out


def _prefix_repetition(args: DatasetArgs, tokenizer: Any) -> list[SampleRequest]:
    rng = np.random.default_rng(args.seed)
    ids = _allowed_ids(tokenizer)
    n_prefixes = max(1, min(args.prefix_repetition_num_prefixes, args.num_prompts))
    per_prefix, extra = divmod(args.num_prompts, n_prefixes)
    out = []
    for p in range(n_prefixes):
        prefix = rng.choice(ids, size=args.prefix_repetition_prefix_len)
        for _ in range(per_prefix + (1 if p < extra else 0)):
            suffix = rng.choice(ids, size=args.prefix_repetition_suffix_len)
            text, length = _text_of(tokenizer, np.concatenate([prefix, suffix]), rng, ids)
            out.append(SampleRequest(text, length, args.prefix_repetition_output_len))
    random.Random(args.seed).shuffle(out)
    return out


def _json_schema(args: DatasetArgs, tokenizer: Any) -> list[SampleRequest]:
    out = []
    for i in range(args.num_prompts):
        prompt, schema = schema_request(i, unique=args.json_schema_unique, min_chars=args.json_schema_min_chars)
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        out.append(
            SampleRequest(prompt, prompt_len, args.json_schema_output_len, None if args.json_schema_off else schema)
        )
    return out


def _sharegpt(args: DatasetArgs, tokenizer: Any) -> list[SampleRequest]:
    if not args.dataset_path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path FILE.json")
    data = json.loads(Path(args.dataset_path).read_text())
    pairs = [
        (d["conversations"][0]["value"], d["conversations"][1]["value"])
        for d in data
        if isinstance(d, dict) and len(d.get("conversations") or []) >= 2
    ]
    random.Random(args.seed).shuffle(pairs)
    out: list[SampleRequest] = []
    for prompt, reply in pairs:
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        output_len = args.sharegpt_output_len or len(tokenizer.encode(reply, add_special_tokens=False))
        # Like the reference client: drop conversations too short to time or too long to serve.
        if prompt_len < 4 or output_len < (1 if args.sharegpt_output_len else 4):
            continue
        if args.sharegpt_output_len is None and (prompt_len > 1024 or prompt_len + output_len > 2048):
            continue
        out.append(SampleRequest(prompt, prompt_len, output_len))
        if len(out) == args.num_prompts:
            break
    if not out:
        raise ValueError(f"{args.dataset_path}: no usable conversation (ShareGPT format expected)")
    usable = len(out)
    while len(out) < args.num_prompts:  # a small file is cycled through
        out.append(out[len(out) % usable])
    return out


_PEOPLE = ("the old sailor", "the baker", "my neighbour", "the young doctor", "a quiet student", "the mayor")
_PLACES = ("the harbour", "the market", "the library", "the station", "the garden", "the river bank")
_ACTS = ("walked to", "painted a picture of", "told a story about", "spent the morning at", "wrote a letter from")
_AFTER = ("before the rain came", "while the bells rang", "as the sun went down", "after a long week")
_SWAPS = (("morning", "evening"), ("the", "a"), ("old", "new"), ("quiet", "busy"), ("long", "short"))


def _prose(rng: random.Random) -> str:
    return (
        f"{rng.choice(_PEOPLE).capitalize()} {rng.choice(_ACTS)} {rng.choice(_PLACES)} {rng.choice(_AFTER)}. "
        f"Everyone said it was the best {rng.choice(('day', 'week', 'morning', 'evening'))} of the year."
    )


def _function(rng: random.Random, i: int) -> str:
    a, b = rng.sample(("width", "height", "count", "total", "price", "rate", "size", "offset"), 2)
    op = rng.choice(("+", "-", "*"))
    return f"def step_{i}({a}, {b}):\n    result = {a} {op} {b}\n    return result\n\n"


def _edit(args: DatasetArgs, tokenizer: Any) -> list[SampleRequest]:
    """Rewrite-with-one-change prompts (see the module doc), half prose and half code."""
    rng = random.Random(args.seed)
    out = []
    for n in range(args.num_prompts):
        code = n % 2 == 1
        parts: list[str] = []
        length = 0
        while length < args.edit_input_len:
            parts.append(_function(rng, len(parts)) if code else _prose(rng) + " ")
            length = len(tokenizer.encode("".join(parts), add_special_tokens=False))
        passage = "".join(parts).strip()
        if code:
            old, new = "result", rng.choice(("value", "answer", "out"))
            ask = f"Rename the variable `{old}` to `{new}` in this code and return the whole code"
        else:
            old, new = rng.choice(_SWAPS)
            ask = f"Rewrite the following text, replacing the word '{old}' with '{new}'; keep everything else"
        prompt = f"{ask}:\n\n{passage}\n\nResult:\n"
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        out.append(SampleRequest(prompt, prompt_len, args.edit_output_len or length))
    return out

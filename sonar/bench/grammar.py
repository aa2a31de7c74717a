"""`sonar bench grammar`: how long structured output specs take to compile, cold and cached.

For each schema of the `json-schema` dataset (`sonar.bench.json_schemas`), each backend compiles
it through Sonar's compile path (`sonar.structured.compiler.GrammarCompiler`, as the engine does):
"cold" is the first compile of a spec (a fresh spec each repeat, so no cache answers), "cached" a
request for a spec compiled before. Also timed: a request's first bitmask (its matcher made and
filled: llguidance compiles lazily, so its work shows here), and filling one bitmask in the start
state (what each step costs per constrained row). The tokenizer is the model's (default: the embedded
SmolLM2-135M-Instruct).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from sonar.bench.json_schemas import SCHEMAS, schema_request
from sonar.bench.model_info import load_tokenizer, resolve_model_files


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sonar bench grammar", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="the model whose tokenizer compiles (default: embedded)")
    parser.add_argument("--backend", action="append", choices=("xgrammar", "guidance"), help="repeatable; both")
    parser.add_argument("--repeats", type=int, default=5, help="cold compiles per schema (each a fresh spec)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    return parser


def run_grammar(args: argparse.Namespace) -> dict[str, Any]:
    from sonar.sampling_params import StructuredOutputsParams
    from sonar.structured.compiler import GrammarCompiler
    from sonar.structured.config import StructuredOutputsConfig

    tokenizer = load_tokenizer(resolve_model_files(args.model).tokenizer_dir)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    compiler = GrammarCompiler(tokenizer, len(tokenizer), eos)
    config = StructuredOutputsConfig()
    rows: list[dict[str, Any]] = []
    setup: dict[str, float] = {}
    for backend in args.backend or ["xgrammar", "guidance"]:
        started = time.perf_counter()
        compiler.backends.get(backend)  # its token table, built once per tokenizer
        setup[backend] = time.perf_counter() - started
        for i, (subject, _) in enumerate(SCHEMAS):
            cold, cached = [], []
            for r in range(args.repeats):
                # A property named after the repeat makes each spec new to the cache.
                _, schema = schema_request(i + len(SCHEMAS) * (r + 1), unique=True, min_chars=0)
                params = StructuredOutputsParams(json=schema, backend=backend)
                t = time.perf_counter()
                grammar = compiler.compile_sync(params, config, max_chars=1 << 20, timeout=120)
                cold.append(time.perf_counter() - t)
                t = time.perf_counter()
                compiler.compile_sync(params, config, max_chars=1 << 20, timeout=120)
                cached.append(time.perf_counter() - t)
            rows.append(
                {
                    "backend": backend,
                    "schema": subject,
                    "cold_ms": statistics.median(cold) * 1e3,
                    "cached_ms": statistics.median(cached) * 1e3,
                    "first_fill_ms": _first_fill(grammar, len(tokenizer)) * 1e3,
                    "fill_us": _fill_us(grammar, len(tokenizer)) * 1e6,
                }
            )
    return {"tokenizer_setup_s": setup, "vocab_size": len(tokenizer), "rows": rows}


def _first_fill(grammar: Any, vocab_size: int) -> float:
    """Seconds to make a request's matcher and fill its first bitmask (where a backend that
    compiles lazily, as llguidance does, does its work)."""
    from sonar.structured.bitmask import allocate_bitmask

    bitmask = allocate_bitmask(1, vocab_size)
    t = time.perf_counter()
    grammar.matcher().fill_bitmask(bitmask, 0)
    return time.perf_counter() - t


def _fill_us(grammar: Any, vocab_size: int) -> float:
    """Seconds to fill one row's bitmask in the grammar's start state (median of 50)."""
    from sonar.structured.bitmask import allocate_bitmask

    matcher = grammar.matcher()
    bitmask = allocate_bitmask(1, vocab_size)
    times = []
    for _ in range(50):
        t = time.perf_counter()
        matcher.fill_bitmask(bitmask, 0)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def format_report(result: dict[str, Any]) -> str:
    setup = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in result["tokenizer_setup_s"].items())
    lines = [
        f"vocabulary {result['vocab_size']}; token tables built once per tokenizer: {setup}",
        f"{'backend':<10} {'schema':<40} {'cold ms':>9} {'cached ms':>10} {'1st fill ms':>12} {'fill us':>9}",
    ]
    for row in result["rows"]:
        lines.append(
            f"{row['backend']:<10} {row['schema']:<40} {row['cold_ms']:>9.2f} {row['cached_ms']:>10.3f} "
            f"{row['first_fill_ms']:>12.2f} {row['fill_us']:>9.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = run_grammar(args)
    print(json.dumps(result, indent=2) if args.json else format_report(result))
    return 0

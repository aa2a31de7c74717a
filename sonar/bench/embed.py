"""`python -m sonar bench embed`: embeddings per second through the library (`sonar.open()`),
beside sentence-transformers on the same model and texts.

The texts are random token ids of the model's vocabulary decoded to text, each ``--input-len``
tokens long before the tokenizer's special tokens. Sonar gets all of them at once (continuous
batching decides how many share a step); sentence-transformers encodes them in batches of
``--st-batch-size``, in this process once Sonar's engine has stopped, so the two never share the
CPU. Both tokenize the texts themselves. The figures are embeddings per second and prompt tokens
per second; with ``--check`` the two sets of vectors are compared (cosine), since a faster
engine that computes another vector is no win.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import anyio

from sonar.bench.throughput import engine_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sonar bench embed", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model", required=True, help="a model folder both load (a sentence-transformers folder for --peer)"
    )
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--max-model-len", default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--kv-cache-memory-bytes", default=None)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--placement", default=None)
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peer", choices=["none", "sentence-transformers"], default="sentence-transformers")
    p.add_argument("--st-batch-size", type=int, default=32)
    p.add_argument("--st-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--check", action="store_true", help="compare the two sets of embeddings (cosine)")
    p.add_argument("--output-json", default=None)
    return p


def random_texts(tokenizer: Any, n: int, length: int, seed: int) -> list[str]:
    """`n` texts of random ordinary tokens, each `length` tokens before special tokens."""
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(len(tokenizer)) if i not in special]
    return [tokenizer.decode([rng.choice(ids) for _ in range(length)]) for _ in range(n)]


async def run_sonar(args: argparse.Namespace, log: Any) -> tuple[dict[str, Any], list[str], list[list[float]]]:
    import sonar

    kwargs = engine_args(args)
    kwargs.setdefault("runner", "pooling")
    started = time.perf_counter()
    async with sonar.open(args.model, **kwargs) as llm:
        ready = time.perf_counter() - started
        texts = await anyio.to_thread.run_sync(random_texts, llm.tokenizer, args.num_prompts, args.input_len, args.seed)
        log(f"bench embed: engine ready in {ready:.1f} s; {len(texts)} texts of {args.input_len} tokens")
        outs: list[Any] = [None] * len(texts)

        async def one(i: int) -> None:
            outs[i] = await llm.embed(texts[i], truncate_prompt_tokens=-1)

        await one(0)  # the first request pays one-time costs
        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i in range(len(texts)):
                tg.start_soon(one, i)
        elapsed = time.perf_counter() - t0
    tokens = sum(o.num_prompt_tokens for o in outs)
    figures = {
        "engine_args": kwargs,
        "startup_seconds": ready,
        "elapsed_time": elapsed,
        "prompt_tokens": tokens,
        "embeddings_per_second": len(texts) / elapsed,
        "tokens_per_second": tokens / elapsed,
    }
    return figures, texts, [o.data.tolist() for o in outs]


def run_sentence_transformers(args: argparse.Namespace, texts: list[str]) -> tuple[dict[str, Any], Any]:
    import torch
    from sentence_transformers import SentenceTransformer

    dtype = getattr(torch, args.st_dtype)
    model = SentenceTransformer(args.model, device="cpu", model_kwargs={"dtype": dtype})
    model.encode(texts[: args.st_batch_size], batch_size=args.st_batch_size)  # warm up
    t0 = time.perf_counter()
    vectors = model.encode(texts, batch_size=args.st_batch_size, convert_to_tensor=True)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(model.tokenizer(text).input_ids) for text in texts)
    return {
        "dtype": args.st_dtype,
        "batch_size": args.st_batch_size,
        "threads": torch.get_num_threads(),
        "elapsed_time": elapsed,
        "embeddings_per_second": len(texts) / elapsed,
        "prompt_tokens": tokens,
    }, vectors.float()


async def run_embed(args: argparse.Namespace, log: Any = print) -> dict[str, Any]:
    sonar_figures, texts, vectors = await run_sonar(args, log)
    result: dict[str, Any] = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "model": args.model,
        "num_prompts": len(texts),
        "input_len": args.input_len,
        "sonar": sonar_figures,
    }
    if args.peer == "sentence-transformers":
        peer, peer_vectors = await anyio.to_thread.run_sync(run_sentence_transformers, args, texts)
        result["sentence_transformers"] = peer
        result["ratio"] = sonar_figures["embeddings_per_second"] / peer["embeddings_per_second"]
        if args.check:
            import torch

            ours = torch.tensor(vectors)
            cos = torch.nn.functional.cosine_similarity(ours, peer_vectors[:, : ours.shape[1]], dim=1)
            result["cosine_min"] = float(cos.min())
    return result


def format_report(r: dict[str, Any]) -> str:
    s = r["sonar"]
    lines = [" Embedding Throughput ".center(56, "="), f"{'Texts x tokens:':<40} {r['num_prompts']} x {r['input_len']}"]
    lines.append(f"{'Sonar embeddings/s:':<40} {s['embeddings_per_second']:.2f}")
    lines.append(f"{'Sonar prompt tokens/s:':<40} {s['tokens_per_second']:.1f}")
    if "sentence_transformers" in r:
        p = r["sentence_transformers"]
        lines.append(f"{'sentence-transformers embeddings/s:':<40} {p['embeddings_per_second']:.2f} ({p['dtype']})")
        lines.append(f"{'Ratio (Sonar / sentence-transformers):':<40} {r['ratio']:.2f}x")
    if "cosine_min" in r:
        lines.append(f"{'Lowest cosine, Sonar vs peer:':<40} {r['cosine_min']:.5f}")
    lines.append("=" * 56)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = anyio.run(run_embed, args, backend="asyncio")
    except (ValueError, TypeError) as exc:
        print(f"bench embed: {exc}", file=sys.stderr)
        return 1
    print(format_report(result))
    if args.output_json:
        path = Path(args.output_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
    return 0

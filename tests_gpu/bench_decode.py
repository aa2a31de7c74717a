"""Model decode benchmark: a Qwen3-0.6B-shaped model (``--load-format dummy``, its published config,
bf16) decoding at batch 1, eager and with CUDA graphs, against the weight-bandwidth floor.

A decode step of one sequence must read every weight once (the tied embedding as the LM head
too), so ``weight bytes / HBM bandwidth`` is the fastest a step can be; the target is a CUDA-graph
step within 2x of that floor. The step timed is the runner's pure-decode path: the forward (graph
replay or eager), the logits of the row and the greedy token read back to the host.

Used by ``tests_gpu.bench_kernels`` (rows of the final table); the helpers also run on a CPU with
any model, which is how ``tests/engine/test_gpu_check.py`` checks them.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from sonar.engine.config import EngineConfig
from sonar.engine.runner import ModelRunner
from sonar.kernels.attention import AttentionMetadata

QWEN3_06B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 1024,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 3072,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "rope_theta": 1000000,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 40960,
    "hidden_act": "silu",
    "attention_bias": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
TARGET_FLOOR_RATIO = 2.0
PROMPT_LEN = 128


def write_config(directory: Path, config: dict | None = None) -> Path:
    """A model directory holding only ``config.json`` (what ``--load-format dummy`` needs)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config or QWEN3_06B_CONFIG))
    return directory


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct parameters (a tied matrix once): what one decode step reads."""
    return sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() skips duplicates


def decode_step_seconds(runner: ModelRunner, steps: int, graphs: bool) -> float:
    """Median seconds of one decode step of one sequence (after a prefill of `PROMPT_LEN` tokens),
    through the captured graph when ``graphs`` and the runner has one, else eager."""
    block = runner.config.block_size
    blocks = -(-(PROMPT_LEN + steps + 1) // block)
    if blocks > runner.num_blocks:
        raise ValueError(f"the benchmark needs {blocks} KV blocks, the runner has {runner.num_blocks}")
    table = list(range(blocks))
    device = runner.device
    with torch.inference_mode():
        meta = AttentionMetadata.build([PROMPT_LEN], [PROMPT_LEN], [table], block, device=device)
        ids = torch.zeros(PROMPT_LEN, dtype=torch.int64, device=device)
        hidden = runner.model(ids, torch.arange(PROMPT_LEN, device=device), runner.kv_caches, meta)
        token = int(runner.model.compute_logits(hidden[-1:]).argmax(-1))
        times = []
        for pos in range(PROMPT_LEN, PROMPT_LEN + steps):
            started = time.perf_counter()
            out = runner.graphs.run([token], [pos], [table]) if graphs and runner.graphs is not None else None
            if out is None:
                meta = AttentionMetadata.build([1], [pos + 1], [table], block, device=device)
                out = runner.model(
                    torch.tensor([token], device=device), torch.tensor([pos], device=device), runner.kv_caches, meta
                )
            token = int(runner.model.compute_logits(out).argmax(-1))  # the host read synchronizes
            times.append(time.perf_counter() - started)
    times.sort()
    return times[len(times) // 2]


MODES = {
    "eager": dict(enforce_eager=True),
    "cuda graphs (-O1)": dict(optimization_level=1),
    "compile + cuda graphs (-O2, the default)": dict(optimization_level=2),
}
"""Each mode's engine settings: eager; CUDA graphs over the eager model (the graphs' own effect);
and the default, graphs over the ``torch.compile``d model (fewer, fused kernels per step)."""


def dummy_runner(directory: Path, enforce_eager: bool = False, **engine_args) -> ModelRunner:
    args = dict(
        load_format="dummy",
        dtype="bfloat16",
        kv_cache_memory_bytes=2**30,
        max_model_len=4096,
        cudagraph_capture_sizes=[1, 2, 4],
        enforce_eager=enforce_eager,
    )
    args.update(engine_args)
    return ModelRunner(EngineConfig.from_args(str(directory), **args))


def model_decode_rows(hbm_gbps: float, quick: bool, directory: Path) -> list[dict]:
    """Rows (as dicts of `tests_gpu.bench_kernels.Row` fields) for eager and CUDA-graph decode."""
    write_config(directory)
    steps = 50 if quick else 200
    rows = []
    floor_ms = None
    results = {}
    for mode, settings in MODES.items():
        runner = dummy_runner(directory, **settings)
        nbytes = weight_bytes(runner.model)
        floor_ms = nbytes / (hbm_gbps * 1e9) * 1e3
        ms = decode_step_seconds(runner, steps, graphs=mode != "eager") * 1e3
        results[mode] = ms
        startup = runner.info.startup_seconds
        del runner
        torch.cuda.empty_cache()
        ratio = ms / floor_ms
        graphs = mode != "eager"
        ok = ratio <= TARGET_FLOOR_RATIO if mode.startswith("compile") else True  # the target: the default
        note = f"{1e3 / ms:,.0f} tok/s; {ratio:.2f}x the weight floor ({floor_ms:.3f} ms for {nbytes / 2**30:.2f} GiB)"
        if graphs:
            note += f"; graph capture {startup.get('graphs', 0):.1f}s"
        if "compile" in startup:
            note += f"; compile {startup['compile']:.1f}s"
        rows.append(
            dict(
                kernel=f"Qwen3-0.6B decode, {mode}",
                shape="batch 1, ctx 128+, bf16, dummy weights",
                ms=ms,
                rate=nbytes / (ms * 1e-3) / 1e9,
                unit="GB/s",
                pct=floor_ms / ms,
                ok=ok,
                note=note,
            )
        )
    for mode in list(MODES)[1:]:
        rows.append(
            dict(
                kernel=f"Qwen3-0.6B decode speedup, {mode}",
                shape="batch 1",
                ms=None,
                rate=None,
                unit="",
                pct=None,
                ok=True,
                note=f"{results['eager'] / results[mode]:.2f}x eager",
            )
        )
    return rows

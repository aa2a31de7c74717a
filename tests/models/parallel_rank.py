"""One rank of a tensor-parallel forward pass, run as its own process by tests/models/test_parallel.py:

    python -m tests.models.parallel_rank PORT RANK SIZE OUT MODEL...

joins the gloo group whose store listens on 127.0.0.1:PORT and, for each MODEL (a checkpoint
directory, or ``embedded`` for SmolLM2 in float32), writes rank 0's `logits` to OUT (a list).
"""

from __future__ import annotations

import sys

import torch

from sonar.kernels.attention import AttentionMetadata, allocate_kv_caches
from sonar.models.loader import load_model
from sonar.models.parallel import SINGLE, TensorParallel

#: Two prompts prefilled together, then one decode step of each.
PREFILL_IDS = [5, 17, 33, 2, 9, 100, 250, 7, 8]
PREFILL_LENS = [5, 4]
DECODE_IDS = [3, 4]


@torch.inference_mode()
def logits(model_source: str, parallel: TensorParallel = SINGLE) -> list[torch.Tensor]:
    """Float32 logits of the prefill rows and of the decode rows of `model_source`."""
    if model_source == "embedded":
        loaded = load_model(None, dtype="float32", dequantize_weights=True, parallel=parallel)
    else:
        loaded = load_model(model_source, dtype="float32", parallel=parallel)
    model = loaded.model
    caches = allocate_kv_caches(model.num_layers, 4, 16, model.num_kv_heads, model.head_dim, torch.float32, "cpu")
    meta = AttentionMetadata.build(PREFILL_LENS, PREFILL_LENS, [[0], [1]], 16)
    positions = torch.cat([torch.arange(n) for n in PREFILL_LENS])
    prefill = model.compute_logits(model(torch.tensor(PREFILL_IDS), positions, caches, meta))
    meta = AttentionMetadata.build([1, 1], [n + 1 for n in PREFILL_LENS], [[0], [1]], 16)
    decode = model.compute_logits(model(torch.tensor(DECODE_IDS), torch.tensor(PREFILL_LENS), caches, meta))
    return [prefill[:, : model.vocab_size], decode[:, : model.vocab_size]]


def main(port: int, rank: int, size: int, out: str, sources: list[str]) -> None:
    from sonar.engine import ranks

    torch.set_num_threads(1)
    parallel = ranks.join(None, ranks.LOOPBACK, port, rank, size, torch.device("cpu"), 120)
    results = [logits(source, parallel) for source in sources]
    if rank == 0:
        torch.save(results, out)


if __name__ == "__main__":
    port, rank, size, out, *sources = sys.argv[1:]
    main(int(port), int(rank), int(size), out, sources)

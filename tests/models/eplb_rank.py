"""One rank of an expert-parallel group under expert load balancing, run as its own process by
tests/models/test_eplb.py:

    python -m tests.models.eplb_rank PORT RANK SIZE OUT MODEL:REDUNDANT:TOKEN...

(or as a job of a `tests.models.rank_pool` worker, which calls `cli` with those arguments)

joins the gloo group of SIZE ranks whose store listens on 127.0.0.1:PORT, loads each MODEL with
its experts in ``linear`` slots plus REDUNDANT replica slots per layer, runs a skewed load twice
(`steps`: a prompt of the model's TOKEN repeated, so every token goes to the same experts) with an
`ExpertBalancer` counting it, rebalances between the two rounds (moving expert weights between
the ranks), and writes to ``OUT.RANK`` for each MODEL: both rounds' logits, every sparse layer's
placement before and after, and the rebalance's record. `balanced_run` with no group is the
single-rank reference.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, replace

import torch

from sonar.core.eplb import EplbConfig
from sonar.engine.ranks import SOLO, Topology
from sonar.kernels.attention import AttentionMetadata, allocate_kv_caches
from sonar.kernels.attention_op import step_metadata
from sonar.models.eplb import ExpertBalancer
from sonar.models.loader import load_model

PROMPT_LEN = 12


def steps(token: int) -> list[tuple[list[int], torch.Tensor, AttentionMetadata]]:
    """A prefill of `token` repeated, then one decode step of it (attention over equal values gives
    equal outputs, so every row of a layer routes alike: all the load on ``top_k`` experts)."""
    return [
        (
            [token] * PROMPT_LEN,
            torch.arange(PROMPT_LEN),
            AttentionMetadata.build([PROMPT_LEN], [PROMPT_LEN], [[0]], 16),
        ),
        ([token], torch.tensor([PROMPT_LEN]), AttentionMetadata.build([1], [PROMPT_LEN + 1], [[0]], 16)),
    ]


@torch.inference_mode()
def balanced_run(source: str, token: int, redundant: int | None = None, topology: Topology = SOLO) -> dict:
    """Both rounds of `steps` (`redundant` None: no balancing, the reference) and what balancing did."""
    loaded = load_model(source, dtype="float32", parallel=topology.tp, redundant_experts=redundant)
    model = loaded.model
    balancer = None
    if redundant is not None:
        blocks = {n: m for n, m in model.named_modules() if getattr(m, "expert_map", None) is not None}
        config = EplbConfig(window_size=8, step_interval=2, num_redundant_experts=redundant)
        balancer = ExpertBalancer(blocks, config, topology.tp)
    caches = allocate_kv_caches(model.num_layers, 4, 16, model.num_kv_heads, model.head_dim, loaded.dtype, "cpu")
    rounds, placements = [], []
    for _ in range(2):
        if balancer is not None:
            placements.append([list(m.placement) for m in balancer.maps])
            if balancer.due:  # between two steps, as the runner does
                balancer.rebalance()
        logits = []
        for ids, positions, meta in steps(token):
            with step_metadata(meta):
                hidden = model.forward_tensors(torch.tensor(ids), positions, caches)
            if balancer is not None:
                balancer.step_done()
            logits.append(model.compute_logits(hidden)[:, : model.vocab_size])
        rounds.append(logits)
    if balancer is None:
        return {"rounds": rounds}
    placements.append([list(m.placement) for m in balancer.maps])
    return {
        "rounds": rounds,
        "placements": placements,
        "local": [list(block.local_experts) for block in balancer.blocks.values()],
        "history": [asdict(r) for r in balancer.history],
    }


def main(port: int, rank: int, size: int, out: str, sources: list[str]) -> None:
    from sonar.engine import ranks

    torch.set_num_threads(1)
    topology = ranks.join(None, ranks.LOOPBACK, port, rank, size, 1, torch.device("cpu"), 120)
    topology = replace(topology, tp=replace(topology.tp, expert_placement="linear"))
    results = []
    for source in sources:
        path, redundant, token = source.rsplit(":", 2)
        results.append(balanced_run(path, int(token), int(redundant), topology))
    torch.save(results, f"{out}.{rank}")
    ranks.leave()


def cli(argv: list[str]) -> None:
    port, rank, size, out, *sources = argv
    main(int(port), int(rank), int(size), out, sources)


if __name__ == "__main__":
    cli(sys.argv[1:])

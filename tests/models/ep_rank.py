"""One rank of an expert-parallel forward pass, run as its own process by
tests/models/test_expert_parallel.py:

    python -m tests.models.ep_rank PORT RANK SIZE PLACEMENT OUT MODEL...

(or as a job of a `tests.models.rank_pool` worker, which calls `cli` with those arguments)

joins the gloo group of SIZE tensor-parallel ranks whose store listens on 127.0.0.1:PORT, deals the
MoE experts over it by PLACEMENT (``linear`` or ``round_robin``) and writes rank 0's logits of each
MODEL (`tests.models.parallel_rank.logits`) to OUT (a list).
"""

from __future__ import annotations

import sys
from dataclasses import replace

import torch

from tests.models import parallel_rank


def main(port: int, rank: int, size: int, placement: str, out: str, sources: list[str]) -> None:
    from sonar.engine import ranks

    torch.set_num_threads(1)
    topology = ranks.join(None, ranks.LOOPBACK, port, rank, size, 1, torch.device("cpu"), 120)
    topology = replace(topology, tp=replace(topology.tp, expert_placement=placement))
    results = [parallel_rank.logits(source, topology) for source in sources]
    if topology.samples:
        torch.save(results, out)
    ranks.leave()


def cli(argv: list[str]) -> None:
    port, rank, size, placement, out, *sources = argv
    main(int(port), int(rank), int(size), placement, out, sources)


if __name__ == "__main__":
    cli(sys.argv[1:])

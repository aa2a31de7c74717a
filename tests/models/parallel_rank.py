"""One rank of a tensor-parallel forward pass, run as its own process by tests/models/test_parallel.py:

    python -m tests.models.parallel_rank PORT RANK TP PP OUT MODEL...

(or as a job of a `tests.models.rank_pool` worker, which calls `cli` with those arguments)

joins the gloo world of TP x PP ranks whose store listens on 127.0.0.1:PORT and, for each MODEL (a
checkpoint directory, ``embedded`` for SmolLM2 in float32, ``embedded-quantized`` for its Q4_1 GGUF as
served, on bfloat16), writes the last stage's `logits`
(from its tensor rank 0) to OUT (a list). Every stage passes its hidden states on as the runner's
stages do (`sonar.engine.ranks.Topology`).
"""

from __future__ import annotations

import functools
import sys

import torch

from sonar.engine.ranks import SOLO, Topology
from sonar.kernels.attention import AttentionMetadata, allocate_kv_caches
from sonar.kernels.attention_op import step_metadata
from sonar.models.loader import load_model

#: Two prompts prefilled together, then one decode step of each.
PREFILL_IDS = [5, 17, 33, 2, 9, 100, 250, 7, 8]
PREFILL_LENS = [5, 4]
DECODE_IDS = [3, 4]


@torch.inference_mode()
def logits(model_source: str, topology: Topology = SOLO) -> list[torch.Tensor] | None:
    """Float32 logits of the prefill rows and of the decode rows of `model_source` (None on a
    stage before the last)."""
    args: dict = {"parallel": topology.tp, "stage": topology.stage}
    if model_source == "embedded":
        loaded = load_model(None, dtype="float32", dequantize_weights=True, **args)
    elif model_source == "embedded-quantized":  # the GGUF's own quants, on bfloat16 activations
        loaded = load_model(None, dtype="bfloat16", **args)
    else:
        loaded = load_model(model_source, dtype="float32", **args)
    model = loaded.model
    caches = allocate_kv_caches(model.num_layers, 4, 16, model.num_kv_heads, model.head_dim, loaded.dtype, "cpu")
    width = loaded.config.hidden_size

    def run(ids: list[int], positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        with step_metadata(meta):
            received = () if model.stage.first else topology.recv_hidden(len(ids), width, loaded.dtype)
            out = model.forward_tensors(torch.tensor(ids), positions, caches, *received)
        if not model.stage.last:
            topology.send_hidden(*out)
            return None
        return model.compute_logits(out)[:, : model.vocab_size]

    prefill = run(PREFILL_IDS, torch.cat([torch.arange(n) for n in PREFILL_LENS]), _meta(PREFILL_LENS, PREFILL_LENS))
    decode = run(DECODE_IDS, torch.tensor(PREFILL_LENS), _meta([1, 1], [n + 1 for n in PREFILL_LENS]))
    return None if prefill is None else [prefill, decode]


@functools.cache
def one_rank_logits(model_source: str) -> list[torch.Tensor]:
    """`logits` on one rank, the reference every group is held to: computed once per process."""
    out = logits(model_source)
    assert out is not None
    return out


def assert_ranks_give_one(
    sources: list[str], got: list[list[torch.Tensor]], atol: float, label: object, same_argmax: bool = False
) -> None:
    """Each source's logits from a group (`got`, as `main` writes them) within `atol` of
    `one_rank_logits`, row for row (and with the same argmax on every row where `same_argmax`);
    `label` names the case in a failure."""
    for source, ranked in zip(sources, got, strict=True):
        for want, have in zip(one_rank_logits(source), ranked, strict=True):
            assert have.shape == want.shape
            assert (have - want).abs().max() < atol, (source, label)
            if same_argmax:
                assert torch.equal(have.argmax(-1), want.argmax(-1)), (source, label)


def _meta(q_lens: list[int], seq_lens: list[int]) -> AttentionMetadata:
    return AttentionMetadata.build(q_lens, seq_lens, [[0], [1]], 16)


def main(port: int, rank: int, tp: int, pp: int, out: str, sources: list[str]) -> None:
    from sonar.engine import ranks

    torch.set_num_threads(1)
    topology = ranks.join(None, ranks.LOOPBACK, port, rank, tp, pp, torch.device("cpu"), 120)
    results = [logits(source, topology) for source in sources]
    if topology.samples:
        torch.save(results, out)
    ranks.leave()


def cli(argv: list[str]) -> None:
    port, rank, tp, pp, out, *sources = argv
    main(int(port), int(rank), int(tp), int(pp), out, sources)


if __name__ == "__main__":
    cli(sys.argv[1:])

"""The fused MoE operator under expert parallelism: a rank holds some experts, stacked by local
index, and the router's ids it does not hold are -1 (`TensorParallel.local_expert_ids`). Each
rank's output from the native kernel, the Triton grouped GEMM (interpreted) and the reference
agree, and the ranks' outputs sum to the whole layer's."""

from __future__ import annotations

import pytest
import torch

from sonar.kernels import moe, native
from sonar.kernels.triton import fused_moe as triton_moe
from sonar.models.parallel import TensorParallel
from tests.kernels.test_moe import CASES, DTYPES, TOLERANCE, close

PATHS = {
    "native": lambda *args: torch.ops.sonar_cpu.fused_moe(*args),
    "triton": triton_moe.fused_experts,
    "reference": moe.fused_experts_reference,
}


def _ranks(experts: int, placement: str) -> list[TensorParallel]:
    size = 2 if experts % 2 == 0 else experts
    return [TensorParallel(rank, size, expert_placement=placement) for rank in range(size)]


@pytest.mark.parametrize("placement", ["linear", "round_robin"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_the_ranks_outputs_sum_to_the_whole_layer(case: str, dtype: torch.dtype, placement: str) -> None:
    assert native.available(), "the native kernels did not build"
    x, weights, ids, w13, w2 = CASES[case](dtype)
    experts = w13.shape[0]
    whole = moe.fused_experts_reference(x, weights, ids, w13, w2)
    sums = {path: torch.zeros(x.shape) for path in PATHS}
    for tp in _ranks(experts, placement):
        local = tp.local_experts(experts)
        local_ids = tp.local_expert_ids(ids, experts)
        args = (x, weights, local_ids, w13[local].contiguous(), w2[local].contiguous())
        want = moe.fused_experts_reference(*args)
        for path, run in PATHS.items():
            got = run(*args)
            close(got, want, dtype)
            sums[path] += got.float()
    for path, total in sums.items():
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(total, whole.float(), atol=2 * tol, rtol=tol, msg=lambda m: f"{path}: {m}")


@pytest.mark.parametrize("path", list(PATHS))
def test_a_token_routed_only_to_other_ranks_gets_zeros(path: str) -> None:
    x, weights, _, w13, w2 = CASES["mixed"](torch.float32)
    ids = torch.full((x.shape[0], 2), -1)
    ids[::2] = torch.tensor([0, 2])  # half the tokens reach this rank's experts 0 and 2
    got = PATHS[path](x, weights, ids, w13, w2)
    assert torch.equal(got[1::2], torch.zeros_like(got[1::2]))
    assert (got[::2].abs().sum(-1) > 0).all()


def test_aligned_blocks_leave_out_the_other_ranks_pairs() -> None:
    ids = torch.tensor([[0, -1], [-1, 1], [1, 0], [-1, -1]])
    block = 4
    sorted_ids, expert_ids, total = triton_moe.align_block_size(ids, 2, block)
    pairs = ids.numel()
    assert sorted_ids.numel() == pairs + 2 * (block - 1) and int(total) == 2 * block
    kept = sorted_ids[sorted_ids < pairs]
    assert sorted(kept.tolist()) == [p for p in range(pairs) if ids.reshape(-1)[p] >= 0]
    assert expert_ids[:2].tolist() == [0, 1]
    assert sorted_ids[:block].tolist() == [0, 5, pairs, pairs]  # expert 0: pairs 0 and 5, padded


def test_expert_ids_outside_minus_one_and_E_are_refused() -> None:
    x, weights, ids, w13, w2 = CASES["mixed"](torch.float32)
    with pytest.raises(RuntimeError, match="expert id -2 outside"):
        torch.ops.sonar_cpu.fused_moe(x, weights, torch.full_like(ids, -2), w13, w2)

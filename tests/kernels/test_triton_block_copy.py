"""The block-copy kernel against the torch reference under the interpreter."""

from __future__ import annotations

import pytest
import torch

from sonar.kernels import reference
from sonar.kernels.triton import copy_blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_copy_blocks_between_caches(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    block = (4, 2, 24)  # block_size, num_kv_heads, head_dim: 192 elements, copied in one chunk
    src = torch.randn(2, 9, *block, generator=gen).to(dtype)
    got = torch.full((2, 5, *block), float("nan")).to(dtype)  # another tier, another size
    want = got.clone()
    src_ids = torch.tensor([7, 0, 3], dtype=torch.int64)
    dst_ids = torch.tensor([4, 1, 2], dtype=torch.int64)
    copy_blocks(src, got, src_ids, dst_ids)
    reference.copy_blocks(src, want, src_ids, dst_ids)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(got[:, 4].view(torch.uint8), src[:, 7].view(torch.uint8))


def test_copy_blocks_in_chunks_and_back() -> None:
    """Blocks larger than one program's chunk (4096 elements); a round trip restores them."""
    gen = torch.Generator().manual_seed(1)
    src = torch.randn(2, 6, 16, 2, 160, generator=gen)  # 5120 elements a block
    staging = torch.full((2, 3, 16, 2, 160), float("nan"))
    back = torch.full_like(src, float("nan"))
    ids = torch.tensor([5, 2, 0], dtype=torch.int32)
    copy_blocks(src, staging, ids, torch.arange(3, dtype=torch.int32))
    copy_blocks(staging, back, torch.arange(3, dtype=torch.int32), ids)
    assert torch.equal(back[:, ids.long()], src[:, ids.long()])
    others = [b for b in range(6) if b not in ids.tolist()]
    assert torch.isnan(back[:, others]).all()

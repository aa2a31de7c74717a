"""Huge-page-backed CPU tensors (`sonar.kernels.hugepages`): the same tensors as ``torch.empty``
gives, 2 MiB-aligned, in a private mapping advised for huge pages before its first touch. (Whether
the kernel then backs it with huge pages is its best effort, not asserted: a fragmented machine
gets 4 KiB pages.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from sonar.kernels import hugepages
from sonar.kernels.linear import pack_native, prepack_linears


def _vm_flags_at(address: int) -> set[str]:
    """The VmFlags of the mapping that holds `address` (Linux ``/proc/self/smaps``)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split()[0]
        if "-" in first and ":" not in first:
            lo, hi = (int(x, 16) for x in first.split("-"))
            inside = lo <= address < hi
        elif inside and first == "VmFlags:":
            return set(line.split()[1:])
    return set()


def test_large_tensor_is_aligned_and_advised_for_huge_pages() -> None:
    t = hugepages.empty((5, 1 << 20), torch.bfloat16)  # 10 MiB
    assert t.shape == (5, 1 << 20) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % hugepages.HUGE_PAGE == 0
    flags = _vm_flags_at(t.data_ptr())
    assert "hg" in flags and "sh" not in flags  # MADV_HUGEPAGE on a private mapping: THP may back it
    t.fill_(3.0)  # first touch: the kernel backs the advised span with huge pages as it can
    assert float(t.float().sum()) == 3.0 * 5 * (1 << 20)


def test_small_tensor_and_gather() -> None:
    small = hugepages.empty((3, 4), torch.float32)
    assert small.shape == (3, 4) and small.is_contiguous()
    sources = [torch.randn(300, 7).t(), torch.randn(5), torch.randn(1024, 1024)]  # one strided
    out = hugepages.gather(sources)
    assert out[0].data_ptr() % hugepages.HUGE_PAGE == 0
    for a, b in zip(out, sources, strict=True):
        assert a.is_contiguous() and a.data_ptr() % 64 == 0 and torch.equal(a, b)
    assert out[1].data_ptr() > out[0].data_ptr() and out[2].data_ptr() > out[1].data_ptr()  # one span
    assert out[2].data_ptr() - out[0].data_ptr() < 2 * 300 * 7 * 4
    with pytest.raises(ValueError):
        hugepages.gather([torch.zeros(3), torch.zeros(3, dtype=torch.bfloat16)])


def test_packed_weights_share_huge_pages() -> None:
    layers = nn.Sequential(nn.Linear(576, 960, bias=False), nn.Linear(960, 576)).bfloat16()
    assert prepack_linears(layers) == 2
    if layers[0].native_layout:  # Sonar's bf16 kernel: both packed weights in one span
        assert layers[0].packed.data_ptr() % hugepages.HUGE_PAGE == 0
        assert layers[1].packed.data_ptr() == layers[0].packed.data_ptr() + layers[0].packed.nbytes
        for layer in layers:
            assert torch.equal(layer.packed, pack_native(layer.weight.detach()))

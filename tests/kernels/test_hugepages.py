"""Huge-page-backed CPU tensors (`sonar.kernels.hugepages`): the same tensors as ``torch.empty``
gives, 2 MiB-aligned, in a private mapping advised for huge pages before its first touch. (Whether
the kernel then backs it with huge pages is its best effort, not asserted: a fragmented machine
gets 4 KiB pages.)"""

from __future__ import annotations

import array
import mmap
from pathlib import Path

import torch
from torch import nn

from sonar.kernels import hugepages
from sonar.kernels.attention import allocate_kv_caches
from sonar.kernels.linear import can_pack, pack_native, prepack_linears


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
    raise AssertionError(f"no VmFlags for address {address:#x}")


def _resident_kib(address: int, nbytes: int) -> int:
    """KiB of ``[address, address + nbytes)`` backed by memory: the present bit of each page's
    ``/proc/self/pagemap`` entry. (Not the ``Rss`` of the mapping: the kernel merges adjacent
    mappings with the same flags, such as an earlier test's touched huge-page span.)"""
    page = mmap.PAGESIZE
    first, last = address // page, (address + nbytes - 1) // page
    entries = array.array("Q")
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * entries.itemsize)
        entries.frombytes(f.read((last - first + 1) * entries.itemsize))
    return sum(entry >> 63 for entry in entries) * page // 1024


def test_large_tensor_is_aligned_and_advised_for_huge_pages() -> None:
    t = hugepages.empty((5, 1 << 20), torch.bfloat16)  # 10 MiB
    assert t.shape == (5, 1 << 20) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % hugepages.HUGE_PAGE == 0
    flags = _vm_flags_at(t.data_ptr())
    assert "hg" in flags and "sh" not in flags  # MADV_HUGEPAGE on a private mapping: THP may back it
    t.fill_(3.0)  # first touch: the kernel backs the advised span with huge pages as it can
    assert float(t.float().sum()) == 3.0 * 5 * (1 << 20)


def test_small_tensor_and_arena() -> None:
    small = hugepages.empty((3, 4), torch.float32)
    assert small.shape == (3, 4) and small.is_contiguous()
    shapes = [(300, 7), (5,), (1024, 1024)]
    out = hugepages.arena(shapes, torch.float32)
    assert out[0].data_ptr() % hugepages.HUGE_PAGE == 0
    for i, (t, shape) in enumerate(zip(out, shapes, strict=True)):
        assert t.shape == shape and t.is_contiguous() and t.data_ptr() % 64 == 0
        t.fill_(i)
    assert [float(t.unique()) for t in out] == [0.0, 1.0, 2.0]  # none overlaps another
    assert out[1].data_ptr() > out[0].data_ptr() and out[2].data_ptr() > out[1].data_ptr()  # one span
    assert out[2].data_ptr() - out[0].data_ptr() < 2 * 300 * 7 * 4
    assert hugepages.arena([], torch.float32) == []


def test_packed_weights_share_huge_pages() -> None:
    layers = nn.Sequential(nn.Linear(576, 960, bias=False), nn.Linear(960, 576)).bfloat16()
    weights = [layer.weight.detach().clone() for layer in layers]
    # none on a CPU that packs bfloat16 for neither kernel (an AVX2-only one)
    assert prepack_linears(layers, keep_weights=True) == (2 if can_pack(weights[0]) else 0)
    if getattr(layers[0], "native_layout", False):  # Sonar's bf16 kernel: both packed weights in one span
        assert layers[0].packed.data_ptr() % hugepages.HUGE_PAGE == 0
        assert layers[1].packed.data_ptr() == layers[0].packed.data_ptr() + layers[0].packed.nbytes
        for layer, weight in zip(layers, weights):
            assert torch.equal(layer.packed, pack_native(weight))
        # a weight update packs again in place: the packed weight stays on the huge pages
        where = layers[1].packed.data_ptr()
        with torch.no_grad():
            layers[1].weight.mul_(-2)
        layers[1].repack()
        assert layers[1].packed.data_ptr() == where
        assert torch.equal(layers[1].packed, pack_native(layers[1].weight.detach()))


def test_zeros_are_zero_and_cost_nothing_until_touched() -> None:
    t = hugepages.zeros((64, 1 << 20), torch.bfloat16)  # 128 MiB
    assert t.shape == (64, 1 << 20) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert _resident_kib(t.data_ptr(), t.nbytes) == 0  # no page backed yet: nothing written at allocation
    t[3].fill_(2.0)
    assert 2048 <= _resident_kib(t.data_ptr(), t.nbytes) < 8192  # the touched row is backed now, and only about it
    assert float(t.float().sum()) == 2.0 * (1 << 20) and not t[4:].any()
    small = hugepages.zeros((3, 5), torch.float32)
    assert torch.equal(small, torch.zeros(3, 5))


def test_cpu_kv_caches_start_zero_without_being_written() -> None:
    caches = allocate_kv_caches(2, 512, 16, 8, 64, torch.bfloat16)  # 2 x 16 MiB
    for cache in caches:
        assert cache.shape == (2, 512, 16, 8, 64) and _resident_kib(cache.data_ptr(), cache.nbytes) == 0
        assert not cache.any()

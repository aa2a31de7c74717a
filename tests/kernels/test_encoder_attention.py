"""encoder_attention: each sequence of a flat batch attends bidirectionally to its own rows only,
through SDPA and through the native CPU kernel (head dims 32, 64, 128)."""

from __future__ import annotations

import pytest
import torch

from sonar.kernels import native
from sonar.kernels.attention import AttentionMetadata
from sonar.kernels.encoder_attention import encoder_attention, sdpa_encoder_attention, sequence_starts, use_native


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], scale: float) -> torch.Tensor:
    """Per sequence, per head: softmax(q k^T * scale) v in float64."""
    out, start = [], 0
    for n in lens:
        rows = slice(start, start + n)
        qs, ks, vs = (x[rows].double().transpose(0, 1) for x in (q, k, v))
        out.append((torch.softmax(qs @ ks.transpose(1, 2) * scale, dim=-1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(out).to(q.dtype)


def metadata(lens: list[int]) -> AttentionMetadata:
    return AttentionMetadata.build(lens, lens, [[0] * -(-n // 16) for n in lens], 16)


@pytest.mark.parametrize("lens", [[5], [7, 1, 12, 3], [4, 4, 4]])
def test_matches_per_sequence_softmax(lens: list[int]) -> None:
    torch.manual_seed(0)
    n = sum(lens)
    q, k, v = (torch.randn(n, 4, 8) for _ in range(3))
    starts = sequence_starts(metadata(lens))
    assert starts == [0, *torch.tensor(lens).cumsum(0).tolist()]
    out = encoder_attention(q, k, v, starts, 8**-0.5)
    assert out.shape == q.shape
    torch.testing.assert_close(out, reference(q, k, v, lens, 8**-0.5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lens", [[6, 3, 5], [4, 4, 4]], ids=["mixed", "equal"])
def test_sequences_do_not_see_each_other(lens: list[int]) -> None:
    torch.manual_seed(1)
    q, k, v = (torch.randn(sum(lens), 2, 8) for _ in range(3))
    starts = sequence_starts(metadata(lens))
    before = encoder_attention(q, k, v, starts, 0.3)
    middle = slice(starts[1], starts[2])  # only the middle sequence's keys and values change
    k2, v2 = k.clone(), v.clone()
    k2[middle], v2[middle] = torch.randn(lens[1], 2, 8), torch.randn(lens[1], 2, 8)
    after = encoder_attention(q, k2, v2, starts, 0.3)
    torch.testing.assert_close(after[: starts[1]], before[: starts[1]])
    torch.testing.assert_close(after[starts[2] :], before[starts[2] :])
    assert not torch.allclose(after[middle], before[middle])


def test_bfloat16() -> None:
    torch.manual_seed(2)
    lens = [9, 2]
    q, k, v = (torch.randn(11, 4, 16, dtype=torch.bfloat16) for _ in range(3))
    out = encoder_attention(q, k, v, sequence_starts(metadata(lens)), 0.25)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(
        out.float(), reference(q.float(), k.float(), v.float(), lens, 0.25), atol=2e-2, rtol=2e-2
    )


@pytest.fixture
def native_kernel() -> bool:
    """Whether the native kernel serves here: the library must build (a machine where it does not
    fails these tests, as it fails tests/kernels/test_native.py); the kernel itself needs AVX-512,
    and where the build has none the same calls must take SDPA and give the same answers."""
    assert native.available(), "the native kernels did not build here"
    return bool(torch.ops.sonar_cpu.has_encoder_attention())


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["float32", "bfloat16", "float16"]
)
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("lens", [[1], [37, 1, 16, 300, 5, 17], [64, 64, 64]], ids=["one", "mixed", "equal"])
def test_native_kernel_matches_the_reference(
    native_kernel: bool, dtype: torch.dtype, head_dim: int, lens: list[int]
) -> None:
    """The native kernel on views of one fused QKV projection (strided rows, as the model calls
    it), against float64 and as close to it as SDPA on the same inputs."""
    gen = torch.Generator().manual_seed(3)
    n, heads = sum(lens), 3
    q, k, v = (torch.randn(n, 3, heads, head_dim, generator=gen) * 2).to(dtype).unbind(1)
    meta = metadata(lens)
    starts = sequence_starts(meta)
    assert use_native(q, k, v) == native_kernel
    out = encoder_attention(q, k, v, starts, head_dim**-0.5, meta.query_start_loc)
    assert out.dtype == dtype and out.shape == q.shape
    want = reference(q.double(), k.double(), v.double(), lens, head_dim**-0.5)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=1e-4)
    else:
        sdpa = sdpa_encoder_attention(q, k, v, starts, head_dim**-0.5).double()
        assert (out.double() - want).abs().mean() <= 1.5 * (sdpa - want).abs().mean() + 1e-4
        torch.testing.assert_close(out.double(), want, atol=3e-2, rtol=3e-2)


@pytest.mark.usefixtures("native_kernel")
def test_native_kernel_keeps_sequences_apart_and_builds_its_own_offsets() -> None:
    gen = torch.Generator().manual_seed(4)
    lens = [20, 3, 33]
    q, k, v = (torch.randn(sum(lens), 2, 32, generator=gen) for _ in range(3))
    starts = sequence_starts(metadata(lens))
    before = encoder_attention(q, k, v, starts, 0.2)  # no offsets tensor given
    k2, v2 = k.clone(), v.clone()
    k2[20:23], v2[20:23] = 5.0, -5.0
    after = encoder_attention(q, k2, v2, starts, 0.2)
    assert torch.equal(after[:20], before[:20]) and torch.equal(after[23:], before[23:])
    assert not torch.allclose(after[20:23], before[20:23])


def test_a_build_without_avx512_refuses_the_kernel_by_name(native_kernel: bool) -> None:
    q = torch.randn(4, 2, 32)
    if native_kernel:
        assert use_native(q, q, q)
        return
    assert not use_native(q, q, q)
    with pytest.raises(RuntimeError, match="encoder_attention: needs AVX-512"):
        torch.ops.sonar_cpu.encoder_attention(q, q, q, torch.tensor([0, 4], dtype=torch.int32), 0.1)


def test_other_head_dims_and_the_switch_take_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    q = torch.randn(4, 2, 16)
    assert not use_native(q, q, q)
    monkeypatch.setenv("SONAR_NATIVE_KERNELS", "0")
    q = torch.randn(4, 2, 32)
    assert not use_native(q, q, q)

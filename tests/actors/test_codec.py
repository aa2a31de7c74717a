"""Tensors and arrays crossing processes as zero-copy frames, and the codec on its own."""

import numpy as np
import pytest
import torch

from sonar.actors import ChildSpec, SupervisorSpec, supervise
from sonar.actors.codec import Codec
from tests.actors.sample import Echo, Sample, Tensors

pytestmark = pytest.mark.anyio


def test_codec_round_trip_keeps_dtype_shape_and_bytes():
    codec = Codec()
    values = [
        torch.randn(3, 4),
        torch.arange(10, dtype=torch.int64)[::2],  # non-contiguous
        torch.randn(2, 3).to(torch.bfloat16),
        torch.zeros(0, 5),
        torch.tensor(7.5),
        np.arange(6, dtype=np.int32).reshape(2, 3),
    ]
    frames = codec.encode({"v": values, "s": "text"})
    assert len(frames) == 1 + len(values)
    out = codec.decode([bytes(f) if not isinstance(f, bytes) else f for f in frames])
    assert out["s"] == "text"
    for a, b in zip(values, out["v"]):
        if isinstance(a, torch.Tensor):
            assert b.dtype == a.dtype and b.shape == a.shape and torch.equal(a, b)
        else:
            assert b.dtype == a.dtype and np.array_equal(a, b)


def test_codec_refuses_objects_it_cannot_send():
    with pytest.raises(TypeError, match="cannot send a object"):
        Codec().encode({"x": object()})


async def test_64_mib_tensor_crosses_intact(placement):
    spec = SupervisorSpec("root", [ChildSpec("a", Sample, placement=placement, ping_interval=None)])
    big = torch.randn(16 * 1024 * 1024)  # 64 MiB of float32
    assert big.numel() * big.element_size() == 64 * 2**20
    async with supervise(spec) as sup:
        reply = await sup.child("a").ref.ask(Tensors([big]), timeout=60)
    assert reply["sums"] == [float(big.double().sum())]
    back = reply["first"]
    assert back.shape == big.shape and back.dtype == big.dtype
    assert torch.equal(back, big)


async def test_message_with_100_small_tensors_and_arrays(placement):
    spec = SupervisorSpec("root", [ChildSpec("a", Sample, placement=placement, ping_interval=None)])
    gen = torch.Generator().manual_seed(0)
    tensors = []
    for i in range(100):
        t = torch.randn(i % 7 + 1, 3, generator=gen)
        tensors.append(t.to([torch.float32, torch.bfloat16, torch.float16, torch.int32][i % 4]) if i % 5 else t.numpy())
    async with supervise(spec) as sup:
        reply = await sup.child("a").ref.ask(Tensors(tensors), timeout=30)
        assert await sup.child("a").ref.ask(Echo("ok"), timeout=5) == "ok"
    expected = [float(torch.as_tensor(t).double().sum()) for t in tensors]
    assert reply["sums"] == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert np.array_equal(reply["first"], tensors[0])

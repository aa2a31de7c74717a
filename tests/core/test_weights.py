"""The checks a weight update passes before anything is written (`sonar.core.weights`)."""

from __future__ import annotations

import pytest

from sonar.core.weights import TensorSpec, WeightTransferConfig, WeightUpdateError, check_update

SERVED = {
    "embed.weight": TensorSpec((8, 4), "float32"),
    "norm.weight": TensorSpec((4,), "float32"),
}


def test_a_subset_of_tensors_in_the_served_dtype_fits() -> None:
    check_update(SERVED, {"norm.weight": TensorSpec((4,), "bfloat16")}, whole=False, dtype="bfloat16")
    check_update(SERVED, {**SERVED, "norm.weight": TensorSpec((4,), "float16")}, whole=True, dtype=None)


@pytest.mark.parametrize(
    ("update", "whole", "dtype", "message"),
    [
        ({}, False, None, "holds no tensor"),
        ({"head.weight": TensorSpec((8, 4), "float32")}, False, None, "no weight named head.weight"),
        ({"norm.weight": TensorSpec((4,), "float32")}, True, None, "lacks embed.weight"),
        ({"norm.weight": TensorSpec((5,), "float32")}, False, None, "has shape [5], the model's is [4]"),
        ({"norm.weight": TensorSpec((4,), "float32")}, False, "bfloat16", "send it in the served dtype, bfloat16"),
        ({"norm.weight": TensorSpec((4,), "int64")}, False, None, "not a floating-point tensor"),
    ],
)
def test_a_mismatch_is_refused_naming_the_tensor(update: dict, whole: bool, dtype: str | None, message: str) -> None:
    with pytest.raises(WeightUpdateError) as info:
        check_update(SERVED, update, whole=whole, dtype=dtype)
    assert message in str(info.value)


def test_the_config() -> None:
    assert WeightTransferConfig.parse(None) is None and WeightTransferConfig.parse({}) == WeightTransferConfig()
    assert WeightTransferConfig.parse({"backend": "sonar"}) == WeightTransferConfig()
    for raw, message in (
        ({"backend": "nccl"}, "NCCL group"),
        ({"backend": "ipc"}, "CUDA IPC"),
        ({"backend": "gloo"}, "gloo group"),
        ({"backend": "rdma"}, "unknown backend"),
        ({"max_update_bytes": -1}, "must be positive"),
        ({"packed": True}, "unknown field"),
    ):
        with pytest.raises(ValueError, match=message):
            WeightTransferConfig.parse(raw)

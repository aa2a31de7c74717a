"""Device selection (`sonar.engine.device`): CUDA when present, SONAR_DEVICE overrides, one index."""

from __future__ import annotations

import pytest
import torch

from sonar.engine.config import EngineConfig
from sonar.engine.device import parse_device_ids, select_device


def test_cpu_without_cuda_and_when_forced() -> None:
    assert select_device(env={}, cuda_available=False) == torch.device("cpu")
    assert select_device(env={"SONAR_DEVICE": "cpu"}, cuda_available=True) == torch.device("cpu")
    assert select_device(env={"SONAR_DEVICE": "CPU"}, cuda_available=False) == torch.device("cpu")


def test_this_machine_runs_on_cpu_when_told(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SONAR_DEVICE", "cpu")
    assert select_device() == torch.device("cpu")


def test_asking_for_cuda_without_one_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="SONAR_DEVICE=cuda but torch sees no CUDA device"):
        select_device(env={"SONAR_DEVICE": "cuda"}, cuda_available=False)
    with pytest.raises(ValueError, match="expected cpu, cuda or cuda:N"):
        select_device(env={"SONAR_DEVICE": "tpu"}, cuda_available=False)


def test_device_ids_takes_one_index() -> None:
    assert parse_device_ids(None) is None
    assert parse_device_ids(" 1 ") == 1
    for bad in ("0,1", "GPU-8f3a", "-1"):
        with pytest.raises(ValueError, match="Sonar serves from one device"):
            parse_device_ids(bad)
    with pytest.raises(ValueError, match="one CUDA index"):
        EngineConfig.from_args(device_ids="0,1")
    assert select_device("3", env={}, cuda_available=False) == torch.device("cpu")

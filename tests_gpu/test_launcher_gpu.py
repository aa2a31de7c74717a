"""torchrun's ranks on GPUs (``external_launcher``): NCCL for the model's collectives, each rank on
GPU ``LOCAL_RANK``, gloo for rank 0's step broadcasts beside them; every rank's greedy and seeded
tokens equal one GPU's. Needs two GPUs; with one, skipped (tests/engine/test_launcher.py runs the
same script on the CPU with gloo)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine import launched_rank
from tests.engine.conftest import save_word_tokenizer, spread_weights
from tests.engine.test_launcher import _single, torchrun
from tests.models.conftest import _tiny_configs

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL takes one GPU per rank: needs two")


def test_two_gpu_ranks_under_torchrun_equal_one_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM

    config = _tiny_configs()["llama3"]
    torch.manual_seed(100)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    spread_weights(hf)
    path = tmp_path / "llama"
    hf.save_pretrained(str(path))
    save_word_tokenizer(path, config.vocab_size)
    monkeypatch.setenv("SONAR_DEVICE", "cuda")
    want = _single(str(path), launched_rank.TEXTS, launched_rank.ENGINE)
    code, ranks = torchrun(tmp_path, 2, "same", str(path))
    assert code == 0
    for calls in ranks:
        assert [call["tokens"] for call in calls] == want

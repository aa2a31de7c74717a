"""The draft model's own checks at load: a draft split over tensor ranks whose heads do not split is
refused as the target would be, naming the draft (no process group is needed to find out: the
shapes are checked before any weight moves)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sonar.core.speculative import SpeculativeConfig
from sonar.engine.drafter import Drafter
from sonar.models.parallel import ParallelLayoutError, TensorParallel


def test_a_draft_whose_heads_do_not_split_over_the_ranks_is_refused_by_name(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=384,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=3,
        num_key_value_heads=3,
        max_position_embeddings=128,
    )
    LlamaForCausalLM(config).save_pretrained(str(tmp_path))
    spec = SpeculativeConfig.parse(
        {"model": str(tmp_path), "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}
    )
    with pytest.raises(
        ParallelLayoutError, match=r"the draft model .*: --tensor-parallel-size 2 does not divide .* \(3\)"
    ):
        Drafter(
            spec,
            dtype="float32",
            device=torch.device("cpu"),
            vocab_size=384,
            block_size=16,
            parallel=TensorParallel(rank=0, size=2),
        )

"""`sonar.bench.step`'s floor: the weights a decode step reads, dense and mixture-of-experts."""

from __future__ import annotations

import pytest
import torch

from sonar.bench.step import decode_floor_ms, step_weights
from sonar.models.llama import LlamaForCausalLM
from sonar.models.qwen_moe import Qwen3MoeForCausalLM


def _qwen3_moe() -> Qwen3MoeForCausalLM:
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        mlp_only_layers=[1],
        architectures=["Qwen3MoeForCausalLM"],
    )
    with torch.device("meta"):
        return Qwen3MoeForCausalLM(config)


def test_a_dense_model_reads_and_multiplies_every_weight() -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    assert not model.tie_word_embeddings  # the input embedding is looked up: one row per token
    read = total - 256 * 64
    assert step_weights(model, 1) == step_weights(model, 64) == (read, read)


def test_a_moe_step_reads_the_experts_its_tokens_reach() -> None:
    model = _qwen3_moe()
    total = sum(p.numel() for p in model.parameters()) - 256 * 64  # less the looked-up embedding
    expert = 3 * 64 * 32  # gate, up and down of one expert
    unused = 2 * (8 - 2) * expert  # two sparse layers (layer 1 is dense), six of eight experts idle per token
    read, per_token = step_weights(model, 1)
    assert read == pytest.approx(total - unused) and per_token == pytest.approx(total - unused)
    read, per_token = step_weights(model, 4)  # 8 (1 - (3/4)^4) ≈ 5.47 experts touched per layer
    assert read == pytest.approx(total - 2 * (8 - 8 * (1 - 0.75**4)) * expert)
    assert per_token == pytest.approx(total - unused)
    assert step_weights(model, 10_000)[0] == pytest.approx(total)
    # batch 1 of the MoE model is bandwidth-bound on its active weights alone
    assert decode_floor_ms(read, per_token, 2, 1, 1.0, 1e9) == pytest.approx(1000 * read * 2 / 1e9)


def test_compare_lora_times_adapter_steps_against_base_steps(capsys: pytest.CaptureFixture[str]) -> None:
    """``--compare-lora``: the adapters' batch really runs with its adapters (each in a slot) and
    the comparison is printed."""
    from sonar.bench.step import compare_lora
    from sonar.engine.config import EngineConfig
    from sonar.engine.runner import ModelRunner

    config = EngineConfig.from_args(
        None, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, num_gpu_blocks_override=64
    )
    runner = ModelRunner(config)
    assert runner.lora is not None
    compare_lora(runner, batch=3, prompt_len=8, steps=2, adapters=2, rank=8)
    assert sorted(runner.lora.slots) == ["bench-adapter-0", "bench-adapter-1"]
    assert "2 adapters of rank 8 / base: decode" in capsys.readouterr().out

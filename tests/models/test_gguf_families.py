"""GGUF files of the families beyond Llama/Qwen: a tiny random transformers model per family,
written as llama.cpp's converter writes it (`tests.models.gguf_writer`), loaded through Sonar:
greedy tokens equal transformers' on the original model and logits within 1e-4 (float32 file);
a Q8_0 file against transformers on the dequantized weights; and the refusals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from sonar.models.errors import ModelLoadError, UnsupportedArchitectureError
from sonar.models.loader import load_model
from tests.models.against import assert_greedy_equals_transformers
from tests.models.conftest import PHI3_LONGROPE
from tests.models.driver import GreedyDriver
from tests.models.gguf_writer import write_gguf

NEW_TOKENS = 12
QUANT_TOLERANCE = 0.05
"""bfloat16 activations against float32 on the same weights: a fraction of the largest logit."""
COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=0,
)


def _configs() -> dict[str, Any]:
    import transformers as tf

    gemma = dict(COMMON, head_dim=32)
    moe = dict(COMMON, intermediate_size=96)
    return {
        "gemma": tf.GemmaConfig(**gemma),
        # the query scale llama.cpp implies (head_dim), a window shorter than the prompts, both caps
        "gemma2": tf.Gemma2Config(
            **gemma,
            sliding_window=8,
            query_pre_attn_scalar=32,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=10.0,
        ),
        # six layers: llama.cpp's implied pattern makes the sixth global; linear scaling on it only
        "gemma3": tf.Gemma3TextConfig(
            **{**gemma, "num_hidden_layers": 6},
            sliding_window=8,
            query_pre_attn_scalar=32,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
            },
        ),
        "phi3": tf.Phi3Config(
            **COMMON, partial_rotary_factor=0.75, original_max_position_embeddings=64, rope_scaling=PHI3_LONGROPE
        ),
        "granite": tf.GraniteConfig(
            **COMMON,
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.2,
            logits_scaling=2.5,
            attention_bias=True,
            mlp_bias=True,
        ),  # fmt: skip
        "olmo2": tf.Olmo2Config(
            **COMMON, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
        ),
        "glm4": tf.Glm4Config(**COMMON, head_dim=16),
        "mixtral": tf.MixtralConfig(**moe, num_local_experts=4, num_experts_per_tok=2, rope_theta=1e6),
        # a shared expert with its gate, top-2 of 6 not renormalized, layer 1 dense
        "qwen2_moe": tf.Qwen2MoeConfig(
            **{**moe, "num_hidden_layers": 3},
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            norm_topk_prob=False,
            mlp_only_layers=[1],
        ),  # fmt: skip
        "qwen3_moe": tf.Qwen3MoeConfig(
            **moe,
            head_dim=32,
            tie_word_embeddings=True,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
        ),  # fmt: skip
    }


ARCHITECTURES = {
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "glm4": "Glm4ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
NAMES = tuple(ARCHITECTURES)
MOE = ("mixtral", "qwen2_moe", "qwen3_moe")


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SONAR_CACHE_ROOT", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def models() -> dict[str, Any]:
    """The transformers models, weights spread so greedy choices are not near-ties (Gemma's
    norms scale by ``1 + weight``: around 0; the others' around 1)."""
    from transformers import AutoModelForCausalLM

    out = {}
    for i, (name, config) in enumerate(_configs().items()):
        torch.manual_seed(100 + i)
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
        with torch.no_grad():
            for pname, param in hf.named_parameters():
                if pname.endswith("norm.weight"):
                    param.copy_((0.0 if name.startswith("gemma") else 1.0) + 0.2 * torch.randn_like(param))
                else:
                    param.copy_(0.15 * torch.randn_like(param))
        assert type(hf).__name__ == ARCHITECTURES[name]
        out[name] = hf
    return out


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in (3, 19, 11)]


@pytest.mark.parametrize("name", NAMES)
def test_float32_file_equals_transformers(name: str, models: dict[str, Any], tmp_path: Path) -> None:
    hf = models[name]
    path = tmp_path / f"{name}.gguf"
    write_gguf(path, name, hf)
    loaded = load_model(str(path), dtype="float32")
    assert loaded.architecture == ARCHITECTURES[name]
    assert_greedy_equals_transformers(loaded.model, hf, _prompts(hf.config.vocab_size), NEW_TOKENS)


#: The families whose GGUF files transformers reads too (``from_pretrained(gguf_file=...)``)
TRANSFORMERS_READS = ("phi3", "gemma2", "gemma3", "qwen2_moe", "qwen3_moe")


@pytest.mark.parametrize("name", TRANSFORMERS_READS)
def test_transformers_reads_the_written_file_as_the_original_weights(
    name: str, models: dict[str, Any], tmp_path: Path
) -> None:
    """A cross-check of the writer against transformers' own GGUF reader (which does not read
    every setting from the metadata, so the original config is handed to it): every tensor
    it maps comes back equal. It maps no dense MLP of an MoE model (Qwen2-MoE's layer 1)."""
    from transformers import AutoModelForCausalLM

    hf = models[name]
    write_gguf(tmp_path / "model.gguf", name, hf)
    theirs, info = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="model.gguf", config=hf.config, dtype=torch.float32, output_loading_info=True
    )
    dense = {
        f"model.layers.{i}.mlp.{p}_proj.weight"
        for i in getattr(hf.config, "mlp_only_layers", [])
        for p in ("gate", "up", "down")
    }
    assert set(info["missing_keys"]) <= dense and not info["mismatched_keys"]
    state = theirs.state_dict()
    for key, value in hf.state_dict().items():
        if key not in info["missing_keys"]:  # Gemma's norms: (w + 1) - 1, one float32 rounding
            torch.testing.assert_close(state[key], value, rtol=0, atol=1e-7, msg=key)


def _reference(hf: Any, state: dict[str, torch.Tensor]) -> Any:
    """transformers on the weights as the file holds them (Q8_0 blocks dequantized)."""
    import copy

    ref = copy.deepcopy(hf)
    ref.load_state_dict(state, strict=False)
    return ref


@pytest.mark.parametrize("name", NAMES)
def test_q8_0_file_equals_transformers_on_its_dequantized_weights(
    name: str, models: dict[str, Any], tmp_path: Path
) -> None:
    """Dequantized (``--dequantize-weights``): transformers on the same dequantized weights,
    within float32's 1e-4. Served as quants where the family takes quantized weights: the
    quantized kernels take bfloat16 activations, so every prompt token's logits within
    `QUANT_TOLERANCE` of the largest (MoE: 90 % of them, a router's near tie may flip)."""
    from gguf import GGMLQuantizationType

    hf = models[name]
    path = tmp_path / f"{name}-q8_0.gguf"
    state = write_gguf(path, name, hf, GGMLQuantizationType.Q8_0)
    assert any(not torch.equal(state[k], v) for k, v in hf.state_dict().items())  # the blocks did round
    ref = _reference(hf, state)
    prompts = _prompts(hf.config.vocab_size)
    loaded = load_model(str(path), dtype="float32", dequantize_weights=True)
    assert loaded.quantization is None
    assert_greedy_equals_transformers(loaded.model, ref, prompts, NEW_TOKENS)
    try:
        quantized = load_model(str(path), dtype="bfloat16")
    except ModelLoadError as exc:  # a family Sonar serves only dequantized says so
        assert "quantized" in str(exc), exc
        return
    assert quantized.quantization == "gguf"
    gen = GreedyDriver(quantized.model, torch.bfloat16, num_blocks=64, block_size=4).generate(
        prompts, 1, prompt_logits=True
    )
    close = []
    for prompt, got in zip(prompts, gen.prompt_logits):
        with torch.inference_mode():
            want = ref(torch.tensor([prompt])).logits[0]
        close.append((got.float() - want).abs().amax(-1) < QUANT_TOLERANCE * want.abs().max())
    # an MoE router's near-tied choice may flip at a token (`tests/models/test_gguf_moe.py`)
    assert torch.cat(close).float().mean() >= (0.9 if name in MOE else 1.0)


def _metadata_only(path: Path, arch: str, **keys: int) -> None:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    for key, value in keys.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_mixtral_experts_one_tensor_each_are_refused(tmp_path: Path) -> None:
    """The old llama.cpp layout of Mixtral (``blk.N.ffn_gate.E.weight``) is not the stacked one."""
    from gguf import GGUFWriter

    path = tmp_path / "old-mixtral.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_expert_count(2)
    writer.add_tensor("blk.0.ffn_gate.0.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="one tensor each.*ffn_gate_exps"):
        load_model(str(path))


def test_experts_of_a_dense_family_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "moe-gemma.gguf"
    _metadata_only(path, "gemma", expert_count=4)
    with pytest.raises(UnsupportedArchitectureError, match="'gemma' with 4 experts per layer"):
        load_model(str(path))


def _minimal_file(path: Path, arch: str, **extra: Any) -> None:
    """A one-layer file of `arch` with the metadata every conversion reads and `extra` keys."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    for add, value in (("block_count", 1), ("context_length", 64), ("embedding_length", 32),
                       ("feed_forward_length", 64), ("head_count", 2), ("vocab_size", 16),
                       ("layer_norm_rms_eps", 1e-6), *extra.items()):  # fmt: skip
        getattr(writer, f"add_{add}")(value)
    writer.add_tensor("token_embd.weight", np.zeros((16, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_keys_a_file_lacks_take_llama_cpps_defaults(tmp_path: Path) -> None:
    """A Gemma 2 file without its soft-capping keys: llama.cpp's (and transformers') 50 and 30."""
    from sonar.models.gguf_file import convert_gguf

    path = tmp_path / "gemma2.gguf"
    _minimal_file(path, "gemma2", sliding_window=8)
    config = json.loads((convert_gguf(path) / "config.json").read_text())
    assert (config["attn_logit_softcapping"], config["final_logit_softcapping"]) == (50.0, 30.0)
    assert config["query_pre_attn_scalar"] == 16  # head_dim: hidden / heads


def test_glm4v_m_rope_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "glm4v.gguf"
    _minimal_file(path, "glm4", rope_dimension_sections=[4, 4, 0, 0])
    with pytest.raises(ModelLoadError, match="M-RoPE sections"):
        load_model(str(path))

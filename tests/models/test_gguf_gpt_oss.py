"""GPT-OSS from GGUF: a tiny random GPT-OSS written as llama.cpp's converter writes it
(`tests.models.gguf_writer`: gate/up de-interleaved and split, sinks as ``attn_sinks``, the router
as ``ffn_gate_inp``, biases beside the stacked experts), in float32 and with MXFP4 experts.

- float32 file: transformers' greedy tokens and logits within 1e-4, through the loader's
  conversion and the served (non-``--dequantize-weights``) path alike;
- MXFP4 experts: served quantized (`QuantizedExperts` over the native MXFP4 kernel, nothing logged
  as dequantized), equal to transformers on the file's dequantized weights (greedy tokens, logits
  within 1e-4 in float32), the blocks having rounded; the experts' resident weights take MXFP4's 17
  bytes per 32 values, not bfloat16's 64;
- the tokenizer and chat template from the file's metadata (a byte-level BPE, as llama.cpp writes
  GPT-OSS's), equal to the tokenizer they were written from;
- a Q8_0 file (attention and head in Q8_0, experts too): attention and experts served as quants,
  equal to transformers on the file's dequantized weights (float32);
- through the engine, with the file's tokenizer: batched, chunked and from the prefix cache,
  transformers' greedy tokens.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch

import sonar
from sonar.models.loader import load_model
from sonar.models.moe import QuantizedExperts
from tests.conftest import fresh_cache_root
from tests.models.against import assert_greedy_equals_transformers, transformers_greedy
from tests.models.gguf_writer import add_bpe_tokenizer, write_gguf
from tests.models.test_gguf_families import _reference
from tests.models.test_gpt_oss import WINDOW, _hf, _prompts, tiny_config

NEW_TOKENS = 8


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SONAR_CACHE_ROOT", str(fresh_cache_root(tmp_path / "cache")))


@pytest.fixture(scope="module")
def hf() -> Any:
    # an intermediate size of whole 32-value blocks, so MXFP4 covers down_proj too
    return _hf(tiny_config(intermediate_size=64), seed=3)


TEMPLATE = "{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>{% endfor %}"


@pytest.fixture(scope="module")
def bpe() -> Any:
    """A byte-level BPE of 300 tokens (two of them special), trained on a few sentences."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(
        ["the quick brown fox jumps over the lazy dog " * 20, "hello world, hello sonar"], trainer
    )
    return tokenizer


def _with_tokenizer(bpe: Any, vocab_size: int) -> Any:
    return functools.partial(add_bpe_tokenizer, tokenizer=bpe, vocab_size=vocab_size, chat_template=TEMPLATE)


def _mxfp4() -> Any:
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType.MXFP4


@pytest.mark.slow
def test_float32_file_equals_transformers(hf: Any, tmp_path: Path) -> None:
    path = tmp_path / "gpt-oss-f32.gguf"
    write_gguf(path, "gpt_oss", hf)
    loaded = load_model(str(path), dtype="float32")
    assert loaded.architecture == "GptOssForCausalLM"
    config = loaded.config
    assert config.layer_types == hf.config.layer_types and config.sliding_window == WINDOW
    assert config.rope_parameters == hf.config.rope_parameters
    assert (config.swiglu_limit, config.swiglu_alpha) == (hf.config.swiglu_limit, hf.config.swiglu_alpha)
    assert [layer.self_attn.sliding_window for layer in loaded.model.own_layers] == [WINDOW, None, WINDOW, None]
    assert_greedy_equals_transformers(loaded.model, hf, _prompts(hf.config.vocab_size), NEW_TOKENS)


def _experts(model: Any) -> list[QuantizedExperts]:
    blocks = [layer.mlp.experts for layer in model.own_layers]
    assert all(isinstance(b, QuantizedExperts) for b in blocks), blocks
    return blocks


def test_mxfp4_experts_are_served_quantized_equal_to_transformers_on_the_dequantized_weights(
    hf: Any, tmp_path: Path
) -> None:
    path = tmp_path / "gpt-oss-mxfp4.gguf"
    state = write_gguf(path, "gpt_oss", hf, _mxfp4())
    rounded = [k for k, v in hf.state_dict().items() if not torch.equal(state[k], v)]
    assert sorted(rounded) == sorted(
        f"model.layers.{i}.mlp.experts.{p}" for i in range(4) for p in ("gate_up_proj", "down_proj")
    ), "only the experts are MXFP4, and their blocks did round"
    ref = _reference(hf, state)
    with structlog.testing.capture_logs() as logs:
        loaded = load_model(str(path), dtype="float32")
    assert not [entry for entry in logs if entry["event"] == "model.gguf_served_dequantized"], logs
    assert loaded.quantization == "gguf"
    c = hf.config
    layers = _experts(loaded.model)
    layer = layers[0][0].gate_up_proj
    assert (layer.meta.format, layer.backend.name) == ("mxfp4", "native")
    # every expert's gate, up and down matrices (4 layers x 4 experts x 3 x 64 x 64 = 196,608
    # weights): 17 bytes per 32 in MXFP4 (104,448 bytes), where bfloat16 would take 393,216
    weights = c.num_hidden_layers * c.num_local_experts * 3 * c.hidden_size * c.intermediate_size
    resident = sum(
        t.nbytes
        for experts in layers
        for m in experts
        for t in [*m.gate_up_proj.packed.values(), *m.down_proj.packed.values()]
    )
    assert weights == 196_608 and resident == weights // 32 * 17 == 104_448
    assert all(name.endswith("_bias") for experts in layers for name, _ in experts.named_parameters(recurse=False)), (
        "no dequantized copy of the experts stays beside them"
    )
    assert (
        loaded.quantized is not None
        and loaded.quantized.formats["mxfp4"] == 2 * c.num_hidden_layers * c.num_local_experts
    )
    assert_greedy_equals_transformers(loaded.model, ref, _prompts(hf.config.vocab_size), NEW_TOKENS)
    assert all(experts.is_stacked for experts in layers), "the grouped operator (sonar_cpu::moe_quant) served them"
    dequantized = load_model(str(path), dtype="float32", dequantize_weights=True)
    assert_greedy_equals_transformers(dequantized.model, ref, _prompts(hf.config.vocab_size)[1:2], 2)


def test_experts_not_all_in_a_served_type_are_read_dequantized(tmp_path: Path) -> None:
    """An intermediate size of 48 leaves ``down_proj`` rows of 48 values, no whole MXFP4 blocks: the
    writer keeps it float32 beside MXFP4 gate/up. Each such block's experts are read dequantized
    (logged per block) and still equal transformers on the file's weights."""
    hf48 = _hf(tiny_config(), seed=4)
    path = tmp_path / "gpt-oss-mixed.gguf"
    ref = _reference(hf48, write_gguf(path, "gpt_oss", hf48, _mxfp4()))
    with structlog.testing.capture_logs() as logs:
        loaded = load_model(str(path), dtype="float32")
    dense = [entry["experts"] for entry in logs if entry["event"] == "model.gguf_experts_dequantized"]
    assert dense == [f"model.layers.{i}.mlp.experts" for i in range(4)], logs
    assert not [entry for entry in logs if entry["event"] == "model.gguf_served_dequantized"], "MXFP4 has a kernel"
    assert not any(isinstance(layer.mlp.experts, QuantizedExperts) for layer in loaded.model.own_layers)
    assert_greedy_equals_transformers(loaded.model, ref, _prompts(hf48.config.vocab_size)[:2], 4)


def test_q8_0_file_serves_its_attention_and_its_experts_quantized(hf: Any, tmp_path: Path) -> None:
    from gguf import GGMLQuantizationType

    path = tmp_path / "gpt-oss-q8_0.gguf"
    ref = _reference(hf, write_gguf(path, "gpt_oss", hf, GGMLQuantizationType.Q8_0))
    with structlog.testing.capture_logs() as logs:
        loaded = load_model(str(path), dtype="float32")
    assert loaded.quantization == "gguf"
    assert type(loaded.model.own_layers[0].self_attn.qkv_proj).__name__ == "QuantLinear"
    assert _experts(loaded.model)[0][0].down_proj.meta.format == "int8"
    assert not [entry for entry in logs if entry["event"] == "model.gguf_served_dequantized"], logs
    assert_greedy_equals_transformers(loaded.model, ref, _prompts(hf.config.vocab_size)[:2], 4)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_engine_greedy_equals_transformers(hf: Any, bpe: Any, tmp_path: Path, anyio_backend: str) -> None:
    """Through `sonar.open` with the file's tokenizer: batched, chunked (a 32-token budget) and
    from the prefix cache."""
    path = tmp_path / "gpt-oss-mxfp4.gguf"
    ref = _reference(hf, write_gguf(path, "gpt_oss", hf, _mxfp4(), _with_tokenizer(bpe, hf.config.vocab_size)))
    prompts = _prompts(hf.config.vocab_size) + [_prompts(hf.config.vocab_size)[2]]
    params = sonar.SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    async with sonar.open(
        str(path),
        dtype="float32",
        num_gpu_blocks_override=64,
        max_num_batched_tokens=32,
        max_num_seqs=8,
    ) as llm:
        outs = await llm.generate_many(prompts, params)
        assert llm.info.architecture == "GptOssForCausalLM"
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == transformers_greedy(ref, prompt, NEW_TOKENS)[0]


def test_the_tokenizer_and_chat_template_come_from_the_file(hf: Any, bpe: Any, tmp_path: Path) -> None:
    path = tmp_path / "gpt-oss-f32.gguf"
    write_gguf(path, "gpt_oss", hf, tokenizer=_with_tokenizer(bpe, hf.config.vocab_size))
    tokenizer = load_model(str(path), dtype="float32").load_tokenizer()
    text = "hello world, the quick brown fox <|start|>"
    assert tokenizer(text).input_ids == bpe.encode(text).ids
    assert tokenizer.decode(bpe.encode(text).ids) == text
    assert tokenizer.eos_token == "<|endoftext|>"
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat == "<|start|>user\nhi<|endoftext|>"

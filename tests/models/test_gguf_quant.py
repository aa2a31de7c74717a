"""GGUF blocks unpacked into Sonar's quantized layout: exactly ggml's values, for every block type
Sonar serves quantized, and the embedded model loaded as quants."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize, quantize

from sonar.kernels.quant import dequantize as sonar_dequantize
from sonar.kernels.quant_linear import QuantEmbedding, QuantLinear
from sonar.models.gguf_quant import BLOCK_TYPES, block_weight
from sonar.models.loader import load_model

ROWS, COLS = 6, 512

# gguf's quantizer covers these; for the K-quants (no quantizer in the gguf package) random
# bytes are valid blocks once their float16 scales are finite, and for MXFP4 random bytes are
# valid as they are (E8M0 exponent bytes from 2^-128, subnormal, up; every E2M1 code)
QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


def _blocks(type_name: str, seed: int) -> np.ndarray:
    """A ``[ROWS, COLS]`` tensor of `type_name` as raw GGUF bytes ``[ROWS, row bytes]``."""
    rng = np.random.default_rng(seed)
    qtype = GGMLQuantizationType[type_name]
    if type_name in QUANTIZABLE:
        weights = rng.normal(0, 0.05, (ROWS, COLS)).astype(np.float32)
        weights[0, :32] = 0.0  # a block of zeros: scale 0
        return quantize(weights, qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (ROWS * COLS // block, size), dtype=np.uint8)
    halves = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "MXFP4": ()}[type_name]
    for at in halves:  # float16 d / dmin: small finite values of either sign
        raw[:, at : at + 2] = rng.normal(0, 1e-3, (raw.shape[0], 1)).astype(np.float16).view(np.uint8)
    if type_name == "MXFP4":
        raw[:, 0] %= 253  # exponents up to 2^124: 12 * 2^124 is still a finite float32
    return raw.reshape(ROWS, -1)


@pytest.mark.parametrize("type_name", sorted(BLOCK_TYPES))
def test_blocks_unpack_to_ggml_values_exactly(type_name: str) -> None:
    for seed in range(3):
        raw = _blocks(type_name, seed)
        qw = block_weight(type_name, raw, ROWS, COLS)
        reference = dequantize(raw, GGMLQuantizationType[type_name]).reshape(ROWS, COLS)
        assert qw.format == BLOCK_TYPES[type_name][0]
        assert qw.group == BLOCK_TYPES[type_name][3]
        ours = sonar_dequantize(qw).numpy()
        np.testing.assert_array_equal(ours, reference.astype(np.float32))


def test_value_ranges_fit_their_format() -> None:
    """int4 values (and MXFP4's codes) are 0..15; the 5- and 6-bit types (int8) stay within their bit
    width."""
    ranges = {"Q4_0": (0, 15), "Q4_1": (0, 15), "Q4_K": (0, 15), "Q5_0": (-16, 15), "Q5_1": (0, 31),
              "Q5_K": (0, 31), "Q6_K": (-32, 31), "Q8_0": (-128, 127), "MXFP4": (0, 15)}  # fmt: skip
    for type_name, (low, high) in ranges.items():
        values = block_weight(type_name, _blocks(type_name, 7), ROWS, COLS).values.to(torch.int16)
        assert low <= int(values.min()) and int(values.max()) <= high, type_name


def test_a_row_of_partial_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="whole number"):
        block_weight("Q4_K", np.zeros((1, 144), np.uint8), 1, 128)


@pytest.fixture(scope="module")
def served_pair() -> tuple[Any, Any]:
    """The embedded model as `sonar serve` runs it (bfloat16), quantized and dequantized."""
    return load_model(None), load_model(None, dequantize_weights=True)


def test_embedded_model_is_served_as_quants(served_pair: tuple[Any, Any]) -> None:
    """SmolLM2's Q4_1 linears become int4 layers, its Q8_0 embedding (tied to the output layer)
    one int8 matrix read by both; every weight equals the dequantized checkpoint's (read through
    the layer, to within the rounding of its bfloat16 output)."""
    quantized, reference = served_pair
    assert quantized.quantization == "gguf" and reference.quantization is None
    model = quantized.model
    assert quantized.quantized.formats == {"int4": 4 * model.num_layers, "int8": 1}
    assert isinstance(model.lm_head, QuantLinear) and isinstance(model.model.embed_tokens, QuantEmbedding)
    assert model.model.embed_tokens.source is model.lm_head
    ref = reference.model
    layer, ref_layer = model.model.layers[3].self_attn.qkv_proj, ref.model.layers[3].self_attn.qkv_proj
    x = torch.eye(layer.in_features, dtype=quantized.dtype)  # bfloat16, or float32 where it is emulated
    torch.testing.assert_close(layer(x).T, ref_layer.weight, rtol=2**-8, atol=1e-6)
    ids = torch.tensor([0, 5, 49151, 1234])
    torch.testing.assert_close(model.model.embed_tokens(ids), ref.model.embed_tokens(ids), rtol=0, atol=0)
    # the quantized weights take the bytes of their GGUF blocks, give or take the float32 scales
    assert quantized.quantized.nbytes < 0.45 * sum(p.numel() * 2 for p in ref.parameters())


PASSAGE = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based inks and a wooden press adapted from those used for wine. "
    "Books, once copied by hand over months, could now be produced in hundreds within weeks, and the "
    "price of a printed page fell so far that pamphlets, calendars and newspapers followed. Within fifty "
    "years presses were running in more than two hundred European cities, and the spread of literacy, "
    "science and religious reform that came after owes much to this machine."
)


def test_quantized_serving_agrees_with_the_dequantized_path(served_pair: tuple[Any, Any], smollm2_prompts) -> None:
    """The issue's bar: the same greedy tokens for at least 90 % of 8 prompts x 16 tokens, and the
    perplexity of a fixed passage within 1 %. Both paths hold the same GGUF weights; they differ
    only in arithmetic (the dequantized path rounds each weight to bfloat16, the quantized one
    applies the float32 scales inside the dot product), so a greedy path parts only at near-ties."""
    from tests.models.driver import GreedyDriver

    quantized, reference = served_pair
    _, prompts = smollm2_prompts
    n = 16
    assert quantized.dtype == reference.dtype  # what --dtype auto serves on this CPU
    ref = GreedyDriver(reference.model, reference.dtype, num_blocks=64).generate(prompts, n)
    # teacher-forced: the quantized model reads the reference's tokens and picks its own next one at
    # each of them, so one near-tie does not turn the rest of an answer into a different text
    forced = [p + t for p, t in zip(prompts, ref.tokens)]
    ours = GreedyDriver(quantized.model, quantized.dtype, num_blocks=64).generate(forced, 1, prompt_logits=True)
    same = 0
    for prompt, tokens, logits in zip(prompts, ref.tokens, ours.prompt_logits):
        picks = logits[len(prompt) - 1 : len(prompt) - 1 + n].argmax(dim=-1).tolist()
        same += sum(a == b for a, b in zip(picks, tokens))
    assert same >= 0.9 * n * len(prompts), same

    tokens = quantized.load_tokenizer()(PASSAGE).input_ids
    ppl = []
    for loaded in served_pair:
        gen = GreedyDriver(loaded.model, loaded.dtype, num_blocks=64).generate([tokens], 1, prompt_logits=True)
        logprobs = torch.log_softmax(gen.prompt_logits[0][:-1].float(), dim=-1)
        nll = -logprobs.gather(1, torch.tensor(tokens[1:]).unsqueeze(1)).mean()
        ppl.append(float(torch.exp(nll)))
    print(f"greedy tokens agreeing {same} of {n * len(prompts)}; perplexity {ppl[0]:.4f} vs {ppl[1]:.4f}")
    assert abs(ppl[0] - ppl[1]) <= 0.01 * ppl[1]


# a Q4_K_M-like mix (K-quants, Q6_K for v and down, Q8_0 embeddings), the legacy types, and a
# file whose attention output is Q3_K (no Sonar kernel: served dequantized)
MIXES = {
    "k-quants": {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q5_K", "gate_proj": "Q4_K",
                 "up_proj": "Q4_K", "down_proj": "Q6_K", "embed_tokens": "Q8_0", "lm_head": "Q6_K"},
    "legacy": {"q_proj": "Q4_0", "k_proj": "Q4_0", "v_proj": "Q4_1", "o_proj": "Q5_0", "gate_proj": "Q5_1",
               "up_proj": "Q5_1", "down_proj": "Q8_0", "embed_tokens": "Q4_1", "lm_head": "Q8_0"},
    "unserved": {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q4_K", "o_proj": "Q3_K", "gate_proj": "Q4_K",
                 "up_proj": "Q4_K", "down_proj": "Q4_K", "embed_tokens": "Q8_0", "lm_head": "Q8_0"},
}  # fmt: skip


def _tiny_quantized_gguf(path: Any, mix: dict[str, str]) -> Any:
    """A 2-layer Llama with 256-wide rows (one K-quant super-block) whose matrices are stored in
    the block types of `mix`: the legacy types quantized from random weights by gguf's quantizer,
    the K-quants as random valid blocks."""
    from transformers import LlamaConfig

    from tests.models.test_gguf import close_gguf, gguf_name, gguf_writer

    config = LlamaConfig(
        vocab_size=384, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    rng = np.random.default_rng(0)
    writer = gguf_writer(path, "llama", config)
    h, inter, kv = config.hidden_size, config.intermediate_size, 2 * 64
    shapes = {"q_proj": (h, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, h), "gate_proj": (inter, h),
              "up_proj": (inter, h), "down_proj": (h, inter)}  # fmt: skip
    for layer in range(config.num_hidden_layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            weight = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
            writer.add_tensor(gguf_name(f"model.layers.{layer}.{norm}.weight"), weight)
        for module, (rows, cols) in shapes.items():
            kind = mix[module]
            prefix = "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            name = gguf_name(f"model.layers.{layer}.{prefix}.{module}.weight")
            writer.add_tensor(name, _raw(kind, rows, cols, rng, config, module), raw_dtype=GGMLQuantizationType[kind])
    writer.add_tensor("output_norm.weight", np.ones(h, np.float32))
    for module, name in (("embed_tokens", "token_embd.weight"), ("lm_head", "output.weight")):
        kind = mix[module]
        writer.add_tensor(
            name, _raw(kind, config.vocab_size, h, rng, config, module), raw_dtype=GGMLQuantizationType[kind]
        )
    close_gguf(writer)
    return config


def _raw(kind: str, rows: int, cols: int, rng: np.random.Generator, config: Any, module: str) -> np.ndarray:
    qtype = GGMLQuantizationType[kind]
    if kind in QUANTIZABLE:
        return quantize(rng.normal(0, 0.06, (rows, cols)).astype(np.float32), qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    halves = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q3_K": (108,)}[kind]
    for at in halves:
        raw[:, at : at + 2] = np.abs(rng.normal(0, 4e-4, (raw.shape[0], 1))).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_a_quantized_file_serves_the_dequantized_logits(mix: str, tmp_path: Any, monkeypatch: Any) -> None:
    """Every layer of a tiny GGUF in each mix of block types loads quantized (or, for a type
    without a kernel, dequantized), and in bfloat16, as served, its logits are as close to the
    exact model's (the same file dequantized, in float32; tests/models/test_gguf.py ties that load
    to transformers) as those of the dequantized bfloat16 load: the two round differently (the
    dequantized path each weight, the quantized one its activations, which its int8 layers also
    round to int8 per group), neither is exact. Measured on these random files: 0.4-6.5 % from the
    truth either way (random blocks make large activations); the bar: three times the dequantized
    load's error, or 8 %."""
    from tests.models.driver import GreedyDriver

    monkeypatch.setenv("SONAR_CACHE_ROOT", str(tmp_path / "cache"))
    path = tmp_path / f"{mix}.gguf"
    _tiny_quantized_gguf(path, MIXES[mix])
    quantized = load_model(str(path), dtype="bfloat16")
    reference = load_model(str(path), dtype="bfloat16", dequantize_weights=True)
    installed = quantized.quantized
    served = {name.rsplit(".", 1)[-1] for name in installed.quantized}
    if mix == "unserved":
        assert installed.dequantized == [] and "o_proj" not in served
        assert isinstance(quantized.model.model.layers[0].self_attn.o_proj, torch.nn.Linear)
    else:
        assert served == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head", "embed_tokens"}
    exact = load_model(str(path), dtype="float32", dequantize_weights=True)  # the truth
    assert exact.quantization is None
    prompts = [[5, 17, 300, 2, 99, 120, 4, 8, 15, 16, 23, 42], [7, 7, 7]]

    def prompt_logits(loaded: Any, dtype: torch.dtype) -> list[torch.Tensor]:
        gen = GreedyDriver(loaded.model, dtype, num_blocks=16).generate(prompts, 1, prompt_logits=True)
        return [t.float() for t in gen.prompt_logits]

    truth = prompt_logits(exact, torch.float32)
    for ours, ref, true in zip(
        prompt_logits(quantized, torch.bfloat16), prompt_logits(reference, torch.bfloat16), truth
    ):
        error = float(torch.linalg.norm(ours - true) / torch.linalg.norm(true))
        ref_error = float(torch.linalg.norm(ref - true) / torch.linalg.norm(true))
        print(f"{mix}: relative error of the prompt logits, quantized {error:.4f}, dequantized {ref_error:.4f}")
        assert error <= max(3 * ref_error, 0.08)
    again = load_model(str(path), dtype="bfloat16")  # from the cache of unpacked quants now
    assert again.quantized.formats == installed.formats


def test_another_method_for_a_gguf_file_is_refused() -> None:
    from sonar.models.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="--quantization awq does not apply to embedded"):
        load_model(None, quantization="awq")

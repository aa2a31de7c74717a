"""The mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE) as tiny random-weight
transformers checkpoints, through the Sonar loader and model against transformers: greedy tokens
equal and logits within 1e-4 (float32), chunked prefills and mixed batches, both checkpoint
layouts of the experts, tensor parallelism on gloo, one run through the whole engine, and the
features these families refuse."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import sonar
from sonar.models.loader import load_model
from sonar.models.moe import SparseMoeBlock
from tests.engine.conftest import save_word_tokenizer, spread_weights
from tests.models import parallel_rank
from tests.models.against import assert_greedy_equals_transformers, assert_mixed_batch_equals_plain_batch
from tests.models.driver import GreedyDriver
from tests.models.rank_pool import RankPool
from tests.models.test_parallel import ATOL as TP_ATOL
from tests.models.test_parallel import _group_logits

NEW_TOKENS = 16


def _configs() -> dict[str, Any]:
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )
    return {
        # every layer sparse, top-2 of 4, renormalized; a sliding window shorter than the prompts
        "mixtral": MixtralConfig(
            **common,
            num_hidden_layers=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=12,
            architectures=["MixtralForCausalLM"],
        ),
        # a shared expert with its sigmoid gate, top-2 of 6 not renormalized, layer 1 dense
        "qwen2_moe": Qwen2MoeConfig(
            **common,
            num_hidden_layers=3,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
            mlp_only_layers=[1],
            architectures=["Qwen2MoeForCausalLM"],
        ),
        # q/k norms, tied embeddings, top-2 of 8 renormalized, every second layer sparse
        "qwen3_moe": Qwen3MoeConfig(
            **common,
            num_hidden_layers=3,
            head_dim=32,
            tie_word_embeddings=True,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=2,
            architectures=["Qwen3MoeForCausalLM"],
        ),
    }


#: Which layers are sparse (the rest dense) in each config above.
SPARSE = {"mixtral": [True, True], "qwen2_moe": [True, False, True], "qwen3_moe": [False, True, False]}
NAMES = tuple(SPARSE)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    from transformers import AutoModelForCausalLM

    out = {}
    for i, (name, config) in enumerate(_configs().items()):
        torch.manual_seed(40 + i)
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        spread_weights(hf)
        path = tmp_path_factory.mktemp(name)
        hf.save_pretrained(str(path))
        save_word_tokenizer(path, config.vocab_size)
        out[name] = (path, hf)
    return out


@pytest.fixture(scope="module", params=NAMES)
def case(request: pytest.FixtureRequest, checkpoints: dict[str, tuple[Path, Any]]) -> tuple[str, Any, Any]:
    path, hf = checkpoints[request.param]
    return request.param, hf, load_model(str(path), dtype="float32")


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in (3, 17, 40, 9)]


def test_loads_as_its_architecture_with_its_sparse_layers(case: Any) -> None:
    name, hf, loaded = case
    assert loaded.architecture == type(hf).__name__
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in loaded.model.model.layers] == SPARSE[name]
    from sonar.models.fused import layer_weights

    assert layer_weights(loaded.model) is None  # the native fused decode computes dense layers only


@pytest.mark.parametrize("name", NAMES)
def test_cached_config_reads_as_transformers_resolved_it(checkpoints: dict[str, tuple[Path, Any]], name: str) -> None:
    """A warm start reads the config from Sonar's cache: every MoE field as transformers resolved it
    (Qwen3-MoE stores ``num_local_experts`` and reads it as ``num_experts``)."""
    from transformers import AutoConfig

    from sonar.models import config_cache

    path = checkpoints[name][0]
    text = (path / "config.json").read_bytes()
    real = AutoConfig.from_pretrained(str(path))
    config_cache.write(text, real)
    cached = config_cache.read(text)
    assert isinstance(cached, config_cache.CachedConfig)
    for field in config_cache.READ:
        if field != "dtype":
            assert getattr(cached, field, None) == getattr(real, field, None), field
    first = load_model(str(path), dtype="float32")
    assert isinstance(first.config, config_cache.CachedConfig)
    assert [type(layer.mlp) for layer in first.model.model.layers] == [
        type(layer.mlp) for layer in load_model(str(path), dtype="float32").model.model.layers
    ]


def test_checkpoint_stores_one_tensor_per_expert(checkpoints: dict[str, tuple[Path, Any]]) -> None:
    """What ``save_pretrained`` writes (and the published checkpoints hold): Mixtral's
    ``block_sparse_moe.experts.N.w1``, Qwen's ``mlp.experts.N.gate_proj``."""
    from safetensors import safe_open

    for name, expected in (("mixtral", "block_sparse_moe.experts.3.w1.weight"), ("qwen2_moe", "mlp.experts.5.up_proj")):
        with safe_open(str(checkpoints[name][0] / "model.safetensors"), "pt") as f:
            assert any(expected in key for key in f.keys()), name


def test_greedy_tokens_and_logits_equal_transformers(case: Any) -> None:
    _, hf, loaded = case
    assert_greedy_equals_transformers(loaded.model, hf, _prompts(loaded.config.vocab_size), NEW_TOKENS)


def test_mixed_batch_equals_plain_batch(case: Any) -> None:
    """Chunked prefills next to decodes, staggered joins: the same tokens and logits."""
    _, _, loaded = case
    assert_mixed_batch_equals_plain_batch(loaded.model, _prompts(loaded.config.vocab_size), NEW_TOKENS)


def test_stacked_expert_layout_loads_the_same_weights(checkpoints: dict[str, tuple[Path, Any]], tmp_path: Path) -> None:
    """A checkpoint of transformers' in-memory names (``mlp.experts.gate_up_proj`` ``[E, 2 I, h]``,
    ``mlp.experts.down_proj``) loads into the same parameters as the per-expert one."""
    from safetensors.torch import save_file

    for name in ("mixtral", "qwen2_moe"):
        path, hf = checkpoints[name]
        state = {k: v.contiguous() for k, v in hf.state_dict().items()}
        assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
        out = tmp_path / name
        out.mkdir()
        save_file(state, str(out / "model.safetensors"))
        (out / "config.json").write_text((path / "config.json").read_text())
        stacked = dict(load_model(str(out), dtype="float32").model.named_parameters())
        for param, value in load_model(str(path), dtype="float32").model.named_parameters():
            assert torch.equal(stacked[param], value), param


def test_bfloat16_follows_float32(checkpoints: dict[str, tuple[Path, Any]]) -> None:
    """The native bfloat16 path: the prompt logits of bfloat16 weights near float32's."""
    path, _ = checkpoints["qwen2_moe"]
    prompts = _prompts(384)[:2]
    runs = {}
    for dtype in ("float32", "bfloat16"):
        loaded = load_model(str(path), dtype=dtype)
        runs[dtype] = GreedyDriver(loaded.model, loaded.dtype, num_blocks=64, block_size=4).generate(
            prompts, 1, prompt_logits=True
        )
    for want, got in zip(runs["float32"].prompt_logits, runs["bfloat16"].prompt_logits):
        scale = want.abs().max()
        assert (got - want).abs().max() < 0.05 * scale


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_split_over_ranks_gives_the_logits_of_one(
    checkpoints: dict[str, tuple[Path, Any]], tp: int, pp: int, rank_pool: RankPool, tmp_path: Path
) -> None:
    """Two gloo ranks: each expert's intermediate size (and the shared expert's, and the dense
    layers') split between them, or the layers (sparse and dense) in two stages."""
    sources = [str(checkpoints[name][0]) for name in ("mixtral", "qwen2_moe")]
    got = _group_logits(rank_pool, tp, pp, sources, tmp_path / "logits.pt")
    parallel_rank.assert_ranks_give_one(sources, got, TP_ATOL, (tp, pp))


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_engine_greedy_equals_transformers(checkpoints: dict[str, tuple[Path, Any]], anyio_backend: str) -> None:
    """Qwen2-MoE through `sonar.open`: batched, chunked (a 32-token budget) and from the prefix cache."""
    path, hf = checkpoints["qwen2_moe"]
    prompts = _prompts(384) + [_prompts(384)[2]]  # the last one repeats a prompt: a prefix-cache hit
    params = sonar.SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    async with sonar.open(
        str(path), dtype="float32", num_gpu_blocks_override=64, max_num_batched_tokens=32, max_num_seqs=8
    ) as llm:
        outs = await llm.generate_many(prompts, params)
        assert llm.info.architecture == "Qwen2MoeForCausalLM"
    for prompt, out in zip(prompts, outs):
        with torch.inference_mode():
            ref = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert out.token_ids == ref[0, len(prompt) :].tolist()


# -- what these families refuse ------------------------------------------------------------------


def test_lora_and_eagle_are_refused(checkpoints: dict[str, tuple[Path, Any]]) -> None:
    from sonar.lora.limits import LoRALimits, ModelShapes
    from sonar.lora.slots import AdapterSlots
    from sonar.models.eagle import load_eagle_head
    from sonar.models.errors import ModelLoadError

    path, _ = checkpoints["mixtral"]
    loaded = load_model(str(path), dtype="float32")
    with pytest.raises(ModelLoadError, match="MixtralForCausalLM is not served with LoRA adapters.*mixture-of-experts"):
        AdapterSlots(
            loaded.model,
            max_loras=1,
            max_cpu_loras=1,
            limits=LoRALimits(),
            shapes=ModelShapes.of_config(loaded.config),
            dtype=torch.float32,
            device=torch.device("cpu"),
        )
    with pytest.raises(ModelLoadError, match="MixtralForCausalLM is not served with EAGLE.*mixture-of-experts"):
        load_eagle_head(str(path), loaded.model, torch.float32, torch.device("cpu"))


def test_unknown_expert_tensors_are_refused(checkpoints: dict[str, tuple[Path, Any]], tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from sonar.models.errors import ModelLoadError

    path, hf = checkpoints["mixtral"]
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    state["model.layers.0.mlp.experts.bias"] = torch.zeros(4)
    save_file(state, str(tmp_path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="no place for weight model.layers.0.mlp.experts.bias"):
        load_model(str(tmp_path), dtype="float32")


def test_quantized_gpt_oss_experts_equal_the_operator_on_their_dequantized_weights() -> None:
    """`QuantizedExperts` with GPT-OSS's biases and clamped SwiGLU over MXFP4 weights on the native
    kernel: three experts (the last never routed), pairs of another rank (id -1), against
    `fused_experts_reference` on the dequantized weights; float32, within 1e-5 (the kernel sums in
    another order)."""
    from sonar.kernels.moe import fused_experts_reference
    from sonar.kernels.quant import dequantize
    from sonar.kernels.quant_linear import QuantLinear
    from sonar.models.moe import QuantizedExperts
    from tests.kernels.test_quant_cpu import mxfp4_weight

    gen = torch.Generator().manual_seed(5)
    experts, hidden, inter = 3, 64, 32
    block = QuantizedExperts(experts, hidden, inter, swiglu_limit=7.0, swiglu_alpha=1.702, bias_dtype=torch.float32)
    w13, w2 = [], []
    for mlp in block:
        gate_up, down = mxfp4_weight(2 * inter, hidden, gen, (122, 126)), mxfp4_weight(hidden, inter, gen, (122, 126))
        mlp.gate_up_proj, mlp.down_proj = QuantLinear(gate_up, None), QuantLinear(down, None)
        assert mlp.gate_up_proj.backend.name == "native"
        w13.append(dequantize(gate_up))
        w2.append(dequantize(down))
    assert block.gate_up_proj_bias is not None and block.down_proj_bias is not None
    block.gate_up_proj_bias.copy_(torch.randn(experts, 2 * inter, generator=gen))
    block.down_proj_bias.copy_(torch.randn(experts, hidden, generator=gen))
    x = torch.randn(7, hidden, generator=gen)
    ids = torch.tensor([[0, 1], [1, -1], [0, -1], [1, 0], [-1, -1], [0, 1], [1, 0]])
    weights = torch.rand(7, 2, generator=gen)
    want = fused_experts_reference(
        x, weights, ids, torch.stack(w13), torch.stack(w2), block.gate_up_proj_bias, block.down_proj_bias, 7.0, 1.702
    )
    torch.testing.assert_close(block(x, weights, ids), want, atol=1e-5, rtol=1e-5)

"""DeepSeek-V2 and V3 as tiny random-weight transformers checkpoints, through the Sonar loader and
model against transformers: greedy tokens equal and logits within 1e-4 (float32), chunked prefills
beside decodes, the whole engine (prefix-cache hit, a token budget that chunks prompts), the size
of the latent KV cache, and what these families refuse.

The configs cover both query paths (``q_proj``, and ``q_lora_rank``'s low-rank pair), every
routing method (V2 ``greedy`` / ``group_limited_greedy``, V3 ``noaux_tc`` with a non-zero
``e_score_correction_bias``), dense first layers (``first_k_dense_replace``), shared experts,
``routed_scaling_factor``, both of V3's rotary layouts and yarn rope scaling whose ``mscale`` /
``mscale_all_dim`` change both the rotation and the softmax scale."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import sonar
from sonar.engine import memory
from sonar.engine.runner import kv_layout
from sonar.models.deepseek import DeepseekMoeBlock, MlaAttention, softmax_scale
from sonar.models.errors import ModelLoadError
from sonar.models.loader import load_model
from tests.engine.conftest import save_word_tokenizer
from tests.models import parallel_rank
from tests.models.against import (
    assert_greedy_equals_transformers,
    assert_mixed_batch_equals_plain_batch,
    transformers_greedy,
)
from tests.models.rank_pool import RankPool
from tests.models.test_parallel import ATOL as TP_ATOL
from tests.models.test_parallel import _group_logits

NEW_TOKENS = 16
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}


def _common(**changes: Any) -> dict[str, Any]:
    return dict(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_attention_heads=4,
        num_key_value_heads=4,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        kv_lora_rank=32,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
        **changes,
    )


def _configs() -> dict[str, Any]:
    from transformers import DeepseekV2Config, DeepseekV3Config

    return {
        # V2-Lite's shape: plain q_proj, greedy top-2 of 4, one shared expert, layer 0 dense
        "v2_lite": DeepseekV2Config(
            **_common(num_hidden_layers=2, q_lora_rank=None),
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            topk_method="greedy",
            architectures=["DeepseekV2ForCausalLM"],
        ),
        # V2's: low-rank queries, top-3 of 8 in the best 2 of 4 groups, scaled, yarn
        "v2": DeepseekV2Config(
            **_common(num_hidden_layers=3, q_lora_rank=24, rope_parameters=YARN),
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_shared_experts=2,
            first_k_dense_replace=1,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.0,
            architectures=["DeepseekV2ForCausalLM"],
        ),
        # V3's: sigmoid scores with a correction bias, top-3 of 8 in the best 2 of 4 groups,
        # renormalized and scaled, interleaved rotary, yarn
        "v3": DeepseekV3Config(
            **_common(num_hidden_layers=3, q_lora_rank=24, rope_parameters=YARN),
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            rope_interleave=True,
            architectures=["DeepseekV3ForCausalLM"],
        ),
        # V3 with the halves rotary, plain q_proj, weights not renormalized, every layer sparse
        "v3_halves": DeepseekV3Config(
            **_common(num_hidden_layers=2, q_lora_rank=None),
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=0,
            n_group=2,
            topk_group=1,
            norm_topk_prob=False,
            routed_scaling_factor=1.5,
            rope_interleave=False,
            architectures=["DeepseekV3ForCausalLM"],
        ),
    }


SPARSE = {"v2_lite": [False, True], "v2": [False, True, True], "v3": [False, True, True], "v3_halves": [True, True]}
NAMES = tuple(SPARSE)


def _hf(config: Any, seed: int) -> Any:
    """transformers' model with weights wide enough that greedy choices are not near ties, and a
    correction bias large enough to change V3's choice of experts."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(0.15 * torch.randn_like(param))
        for name, buffer in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn_like(buffer))
    return hf


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    out = {}
    for i, (name, config) in enumerate(_configs().items()):
        hf = _hf(config, seed=60 + i)
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


def test_loads_as_its_architecture_with_its_layers(case: Any) -> None:
    name, hf, loaded = case
    assert loaded.architecture == type(hf).__name__
    layers = loaded.model.model.layers
    assert [isinstance(layer.mlp, DeepseekMoeBlock) for layer in layers] == SPARSE[name]
    assert all(isinstance(layer.self_attn, MlaAttention) for layer in layers)
    from sonar.models.fused import layer_weights

    assert layer_weights(loaded.model) is None  # the native decode loop computes Llama's layers only


def test_greedy_tokens_and_logits_equal_transformers(case: Any) -> None:
    _, hf, loaded = case
    assert_greedy_equals_transformers(loaded.model, hf, _prompts(loaded.config.vocab_size), NEW_TOKENS)


def test_mixed_batch_equals_plain_batch(case: Any) -> None:
    """Chunked prefills over cached latents next to decodes, staggered joins: the same tokens."""
    _, _, loaded = case
    assert_mixed_batch_equals_plain_batch(loaded.model, _prompts(loaded.config.vocab_size), NEW_TOKENS)


@pytest.mark.parametrize("name", ["v2", "v3"])
def test_a_warm_start_from_the_cached_config_gives_the_same_tokens(
    checkpoints: dict[str, tuple[Path, Any]], name: str
) -> None:
    """The config cache (a warm start reads no transformers config) keeps every field DeepSeek
    reads, the MLA and routing ones outside `config_cache.READ` included."""
    from transformers import AutoConfig

    from sonar.models import config_cache
    from tests.models.driver import GreedyDriver

    path, hf = checkpoints[name]
    text = (path / "config.json").read_bytes()
    config_cache.write(text, AutoConfig.from_pretrained(str(path)))
    warm = load_model(str(path), dtype="float32")
    assert isinstance(warm.config, config_cache.CachedConfig)
    prompt = _prompts(384)[2]
    got = GreedyDriver(warm.model, torch.float32, num_blocks=32, block_size=4).generate([prompt], 4)
    assert got.tokens[0] == transformers_greedy(hf, prompt, 4)[0]


def test_bfloat16_follows_float32(checkpoints: dict[str, tuple[Path, Any]]) -> None:
    """bfloat16 weights, packed as the runner packs them (the native kernels where the CPU has
    them): the prompt logits near float32's, at all but a few positions (a token whose router
    scores nearly tie in float32 may go to another expert in bfloat16: one of 60 here)."""
    from sonar.kernels.linear import prepack_linears
    from tests.models.driver import GreedyDriver

    path, _ = checkpoints["v3"]
    prompts = _prompts(384)[:3]
    runs = {}
    for dtype in ("float32", "bfloat16"):
        loaded = load_model(str(path), dtype=dtype)
        prepack_linears(loaded.model)
        runs[dtype] = GreedyDriver(loaded.model, loaded.dtype, num_blocks=64, block_size=4).generate(
            prompts, 2, prompt_logits=True
        )
    want, got = torch.cat(runs["float32"].prompt_logits), torch.cat(runs["bfloat16"].prompt_logits)
    close = (got - want).abs().amax(dim=-1) < 0.05 * want.abs().max()
    assert close.float().mean() >= 0.95, f"{int((~close).sum())} of {len(close)} positions differ"


def test_the_cache_holds_one_latent_head_per_token(checkpoints: dict[str, tuple[Path, Any]]) -> None:
    """The engine sizes the cache from `kv_layout`: one head of ``kv_lora_rank + qk_rope_head_dim``
    (keys, and the same again as values), not ``num_heads`` heads of the expanded keys and values."""
    path, hf = checkpoints["v3"]
    c = hf.config
    loaded = load_model(str(path), dtype="float32")
    layers, heads, width = kv_layout(loaded.model)
    assert (layers, heads, width) == (3, 1, c.kv_lora_rank + c.qk_rope_head_dim) == (3, 1, 40)
    per_block = memory.kv_bytes_per_block(layers, 16, heads, width, torch.bfloat16)
    assert per_block == 2 * 3 * 16 * 40 * 2  # bytes: K and V halves, layers, tokens, width, bf16
    expanded = 3 * 16 * c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim) * 2
    assert per_block < expanded  # 7680 < 13824 bytes here; at V3's own shapes 1152 vs 40960 elements


def test_softmax_scale_follows_yarn_mscale_all_dim(checkpoints: dict[str, tuple[Path, Any]]) -> None:
    hf = checkpoints["v3"][1]
    assert softmax_scale(hf.config) == pytest.approx(hf.model.layers[0].self_attn.scaling)
    assert softmax_scale(hf.config) != pytest.approx(24**-0.5)
    plain = checkpoints["v3_halves"][1]
    assert softmax_scale(plain.config) == pytest.approx(24**-0.5)


def test_multi_token_prediction_layers_are_not_loaded(checkpoints: dict[str, tuple[Path, Any]], tmp_path: Path) -> None:
    """V3 checkpoints carry their MTP module as layer ``num_hidden_layers``: skipped, the rest served."""
    from safetensors.torch import load_file, save_file

    path, hf = checkpoints["v3"]
    state = load_file(str(path / "model.safetensors"))
    for key in [k for k in state if k.startswith("model.layers.2.")]:
        state[key.replace("model.layers.2.", "model.layers.3.")] = state[key].clone()
    state["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(state, str(tmp_path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_model(str(tmp_path), dtype="float32")
    prompt = _prompts(384)[1]
    from tests.models.driver import GreedyDriver

    got = GreedyDriver(loaded.model, torch.float32, num_blocks=32, block_size=4).generate([prompt], 4)
    assert got.tokens[0] == transformers_greedy(hf, prompt, 4)[0]


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (2, 2)], ids=["tp2", "pp2", "tp2xpp2"])
def test_split_over_ranks_gives_the_logits_of_one(
    checkpoints: dict[str, tuple[Path, Any]], tp: int, pp: int, rank_pool: RankPool, tmp_path: Path
) -> None:
    """gloo ranks: the query heads (``q_b_proj`` / ``q_proj``, ``kv_b_proj``, ``o_proj``) and every
    expert's intermediate size split between two ranks, each caching the whole latent; or the
    layers (dense and sparse) in two stages; or both."""
    sources = [str(checkpoints[name][0]) for name in ("v2_lite", "v3")]
    got = _group_logits(rank_pool, tp, pp, sources, tmp_path / "logits.pt")
    parallel_rank.assert_ranks_give_one(sources, got, TP_ATOL, (tp, pp))


@pytest.mark.parametrize("placement", ["linear", "round_robin"])
def test_expert_parallel_gives_the_logits_of_one(
    checkpoints: dict[str, tuple[Path, Any]], placement: str, rank_pool: RankPool, tmp_path: Path
) -> None:
    """Two gloo ranks holding whole experts each (the router's choice mapped to local ids, the
    shared experts and attention tensor-parallel)."""
    from tests.models.test_expert_parallel import ATOL as EP_ATOL
    from tests.models.test_expert_parallel import _group_logits as _ep_group_logits

    sources = [str(checkpoints[name][0]) for name in ("v2", "v3")]
    got = _ep_group_logits(rank_pool, 2, placement, sources, tmp_path / "logits.pt")
    parallel_rank.assert_ranks_give_one(sources, got, EP_ATOL, placement)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_engine_greedy_equals_transformers(checkpoints: dict[str, tuple[Path, Any]], anyio_backend: str) -> None:
    """V3 through `sonar.open`: a prompt served from cached latent blocks, chunked prefills (a
    32-token budget) and preemptions (12 blocks of 16 tokens for ~330 tokens of context)."""
    path, hf = checkpoints["v3"]
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 384, (n,), generator=gen).tolist() for n in (40, 3, 64, 17, 33, 9)]
    prompts.append(prompts[2][:48] + prompts[0][:10])  # shares three 16-token blocks with prompt 2
    params = sonar.SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    async with sonar.open(
        str(path),
        dtype="float32",
        enable_prefix_caching=True,
        num_gpu_blocks_override=12,
        max_num_batched_tokens=32,
        max_num_seqs=8,
    ) as llm:
        assert llm.info.architecture == "DeepseekV3ForCausalLM"
        first = await llm.generate(prompts[2], params)
        outs = await llm.generate_many(prompts, params)
        stats = await llm.stats()
    assert stats.num_preemptions > 0, "the small KV pool preempted nothing"
    assert stats.prefix_hits > 0, "nothing was served from the prefix cache"
    assert outs[2].token_ids == first.token_ids
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert out.token_ids == transformers_greedy(hf, prompt, NEW_TOKENS)[0], f"prompt {i}"


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "tp2-ep"])
async def test_engine_at_two_ranks_equals_transformers(
    checkpoints: dict[str, tuple[Path, Any]], anyio_backend: str, expert_parallel: bool
) -> None:
    """V2 through `sonar.open(tensor_parallel_size=2)`, experts sliced or dealt whole: greedy
    tokens of a batch equal transformers'."""
    path, hf = checkpoints["v2"]
    prompts = _prompts(384)[:3]
    params = sonar.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    async with sonar.open(
        str(path),
        dtype="float32",
        num_gpu_blocks_override=64,
        tensor_parallel_size=2,
        enable_expert_parallel=expert_parallel,
    ) as llm:
        outs = await llm.generate_many(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == transformers_greedy(hf, prompt, 8)[0]


# -- what these families refuse ------------------------------------------------------------------


def _config_with(checkpoints: dict[str, tuple[Path, Any]], name: str, tmp_path: Path, **fields: Any) -> Path:
    path = checkpoints[name][0]
    config = json.loads((path / "config.json").read_text())
    config.update(fields)
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")
    return tmp_path


@pytest.mark.parametrize(
    ("name", "fields", "message"),
    [
        ("v2", {"norm_topk_prob": True}, "DeepseekV2ForCausalLM: norm_topk_prob true is not supported"),
        ("v2", {"topk_method": "noaux_tc"}, "DeepseekV2ForCausalLM: topk_method 'noaux_tc' is not supported"),
        ("v3", {"topk_method": "greedy"}, "DeepseekV3ForCausalLM: topk_method 'greedy' is not supported"),
        ("v2", {"moe_layer_freq": 2}, "moe_layer_freq 2 is not supported"),
        ("v3", {"n_group": 3}, "n_group 3 / topk_group 2 do not fit 8 routed experts"),
        ("v3", {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ("v3", {"scoring_func": "softmax"}, "DeepseekV3ForCausalLM: scoring_func 'softmax' is not supported"),
    ],
    ids=["v2-norm-topk", "v2-noaux", "v3-greedy", "layer-freq", "groups", "act", "scoring"],
)
def test_config_fields_not_served_are_refused(
    checkpoints: dict[str, tuple[Path, Any]], tmp_path: Path, name: str, fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(_config_with(checkpoints, name, tmp_path, **fields)), dtype="float32")


def test_quantized_safetensors_checkpoints_are_refused() -> None:
    """GGUF quants are served (`tests/models/test_gguf_deepseek.py`); GPTQ / AWQ / FP8 are not."""
    from sonar.models.deepseek import DeepseekV3ForCausalLM

    with pytest.raises(ModelLoadError, match="DeepseekV3ForCausalLM is not served with quantized weights.*FP8"):
        DeepseekV3ForCausalLM.require_support("quantized weights")


def test_lora_and_eagle_are_refused(checkpoints: dict[str, tuple[Path, Any]]) -> None:
    from sonar.models.deepseek import DeepseekV2ForCausalLM

    with pytest.raises(ModelLoadError, match="DeepseekV2ForCausalLM is not served with LoRA adapters"):
        DeepseekV2ForCausalLM.require_support("LoRA adapters")
    with pytest.raises(ModelLoadError, match="DeepseekV2ForCausalLM is not served with EAGLE"):
        DeepseekV2ForCausalLM.require_support("EAGLE speculative decoding")


@pytest.mark.parametrize("name", ["v2_lite", "v2", "v3", "v3_halves"])
def test_router_chooses_as_transformers(checkpoints: dict[str, tuple[Path, Any]], name: str) -> None:
    """Over 512 random tokens, a sparse block's router picks transformers' experts with
    transformers' weights (``routed_scaling_factor`` included)."""
    path, hf = checkpoints[name]
    loaded = load_model(str(path), dtype="float32")
    block, ref = loaded.model.model.layers[1].mlp, hf.model.layers[1].mlp.gate
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(3))
    weights, ids = block.route(x)
    with torch.inference_mode():
        _, ref_weights, ref_ids = ref(x)
    ours, theirs = ids.sort(dim=-1), ref_ids.sort(dim=-1)
    assert torch.equal(ours.values, theirs.values)
    torch.testing.assert_close(
        weights.gather(1, ours.indices), ref_weights.gather(1, theirs.indices), atol=1e-6, rtol=1e-6
    )

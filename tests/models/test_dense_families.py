"""Phi-3, Granite, OLMo 2 and GLM-4 beyond the per-architecture model tests
(tests/models/test_architectures.py runs their tiny checkpoints through GreedyDriver):

* through the whole engine (`sonar.open`: batching, chunked prefill, preemption, the prefix
  cache), greedy tokens and logprobs equal transformers';
* LongRoPE is served up to max_position_embeddings, and a longer prompt is refused (past the
  original context: tests/models/test_phi3_longrope.py);
* tensor and pipeline parallel groups give the logits of one rank;
* LoRA adapters (Granite, OLMo 2, GLM-4) equal peft's; GPTQ and AWQ checkpoints (Granite, OLMo 2)
  equal transformers on their dequantized weights;
* the native fused decode serves Phi-3's whole-head rotary bit for bit, and nothing else here;
* the features they are not served with are refused at the start, naming the family.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import sonar
from sonar.errors import InvalidRequestError, LoRAError
from sonar.kernels.quant_linear import QuantLinear
from sonar.lora.adapter import read_adapter
from sonar.lora.limits import LoRALimits, ModelShapes
from sonar.lora.slots import AdapterSlots
from sonar.models.decoder import EAGLE, LORA, QUANTIZED, TENSOR_PARALLEL
from sonar.models.eagle import load_eagle_head
from sonar.models.errors import ModelLoadError
from sonar.models.fused import layer_weights
from sonar.models.loader import load_model
from sonar.models.parallel import TensorParallel
from sonar.models.registry import model_class
from tests.engine.conftest import save_word_tokenizer, spread_weights
from tests.lora.conftest import ALL_MODULES, make_adapter, peft_greedy
from tests.models import parallel_rank
from tests.models.against import transformers_greedy
from tests.models.conftest import _tiny_configs
from tests.models.quantization.test_load import CASES as QUANT_CASES
from tests.models.quantization.test_load import _compare as compare_quantized
from tests.models.quantization.test_load import _load as load_quantized
from tests.models.quantization.test_load import _reference as quantized_reference
from tests.models.quantization.test_load import _tiny as quantized_tiny
from tests.models.quantization.test_load import _write as write_quantized
from tests.models.rank_pool import RankPool
from tests.models.test_fused import _assert_same as assert_same_steps
from tests.models.test_fused import _both as fused_and_per_op
from tests.models.test_parallel import ATOL as PARALLEL_ATOL
from tests.models.test_parallel import _group_logits

FAMILIES = ("phi3", "granite", "olmo2", "glm4")
NEW_TOKENS = 24
LORA_TOKENS = 10
GRANITE_SCALARS = dict(
    embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.5, attention_bias=True
)
#: Tiny models in float32: the engine's logprobs against transformers' log-softmax.
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def engine_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """Each family's tiny config (tests/models/conftest.py), saved with a word tokenizer."""
    from transformers import AutoModelForCausalLM

    configs = _tiny_configs()
    out = {}
    for i, name in enumerate(FAMILIES):
        torch.manual_seed(200 + i)
        hf = AutoModelForCausalLM.from_config(configs[name], dtype=torch.float32).eval()
        spread_weights(hf)
        path = tmp_path_factory.mktemp(f"dense-{name}")
        hf.save_pretrained(str(path))
        save_word_tokenizer(path, hf.config.vocab_size)
        out[name] = (path, hf)
    return out


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    # at most 40 + 24 tokens: within Phi-3's original context of 64 (its short factors)
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in (3, 17, 40, 9, 33, 25, 40)]


def _transformers_greedy(hf: Any, prompt: list[int], n: int = NEW_TOKENS) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and the log-probabilities of the distributions they came from."""
    tokens, logits = transformers_greedy(hf, prompt, n)
    return tokens, torch.log_softmax(logits, dim=-1)


@pytest.mark.anyio
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name", FAMILIES)
async def test_engine_greedy_equals_transformers(name: str, engine_checkpoints: dict[str, tuple[Path, Any]]) -> None:
    """Seven prompts at once under a 32-token step budget (prompts prefill in chunks beside
    decodes) and a cache of 8 blocks of 16 (requests are preempted and recomputed); the last
    prompt repeats the third (a prefix-cache hit)."""
    path, hf = engine_checkpoints[name]
    prompts = _prompts(hf.config.vocab_size)
    prompts[-1] = prompts[2]
    params = sonar.SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=3)
    async with sonar.open(
        str(path), dtype="float32", max_num_batched_tokens=32, max_num_seqs=8, num_gpu_blocks_override=8
    ) as llm:
        outs = await llm.generate_many(prompts, params)
        stats = await llm.stats()
        assert llm.info.architecture == type(hf).__name__
        assert stats.num_free_blocks == llm.info.num_blocks
        assert stats.num_preemptions > 0 and stats.prefix_hits > 0
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        tokens, logprobs = _transformers_greedy(hf, prompt)
        assert out.token_ids == tokens, f"prompt {i}"
        ours = torch.tensor([p.logprob for p in out.logprobs])
        torch.testing.assert_close(ours, logprobs[torch.arange(NEW_TOKENS), tokens], atol=LOGPROB_ATOL, rtol=0)


@pytest.mark.anyio
@pytest.mark.usefixtures("one_thread")
async def test_longrope_serves_max_position_embeddings(engine_checkpoints: dict[str, tuple[Path, Any]]) -> None:
    """Phi-3's tiny config: max_position_embeddings 256, original context 64. Past 64 a sequence
    takes the long factors (tests/models/test_phi3_longrope.py); past 256 nothing is served."""
    path, hf = engine_checkpoints["phi3"]
    assert (hf.config.max_position_embeddings, hf.config.rope_parameters["original_max_position_embeddings"]) == (
        256,
        64,
    )
    assert load_model(str(path), dtype="float32").max_model_len == 256
    with pytest.raises(ValueError, match="max_model_len 300 exceeds the model's maximum 256"):
        async with sonar.open(str(path), dtype="float32", max_model_len=300):
            pass
    async with sonar.open(str(path), dtype="float32", num_gpu_blocks_override=20) as llm:
        assert llm.info.max_model_len == 256 and llm.info.longrope_switch == 64
        with pytest.raises(InvalidRequestError, match="maximum context length is 256 tokens"):
            await llm.generate([1] * 257, sonar.SamplingParams(max_tokens=1))


def test_dynamic_rope_serves_max_position_embeddings(tiny_checkpoints: dict[str, Any]) -> None:
    """Granite's tiny config scales rope dynamically: nothing changes below max_position_embeddings."""
    loaded = load_model(str(tiny_checkpoints["granite"].path), dtype="float32")
    assert loaded.config.rope_parameters["rope_type"] == "dynamic"
    assert loaded.max_model_len == loaded.config.max_position_embeddings == 256


@pytest.mark.parametrize("name", FAMILIES)
def test_native_fused_decode_serves_only_whole_llama_layers(name: str, tiny_checkpoints: dict[str, Any]) -> None:
    """Granite's multipliers, OLMo 2's and GLM-4's norms are not what the native loop computes;
    Phi-3's layers are Llama's, but this one rotates 3/4 of each head."""
    model = load_model(str(tiny_checkpoints[name].path), dtype="float32").model
    assert model.variant.native_decode is (name == "phi3")
    assert layer_weights(model) is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_phi3_native_fused_decode_equals_the_per_op_path_and_transformers(
    dtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Phi-3 rotating whole heads (Phi-3-mini, Phi-4) with LongRoPE and a sliding window shorter
    than the prompts: decode steps take the native loop, bit for bit the per-op path's logits and
    KV cache (tests/models/test_fused.py), and in float32 transformers' greedy tokens."""
    from transformers import AutoModelForCausalLM, Phi3Config

    config = _tiny_configs()["phi3"].to_dict()
    rope = {"type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.4, 1.6, 1.8, 2.0, 2.2], "long_factor": [4.0] * 8}
    config.update(partial_rotary_factor=1.0, rope_scaling=rope, sliding_window=8)
    config.pop("rope_parameters", None)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(Phi3Config(**config), dtype=torch.float32).eval()
    spread_weights(hf)
    hf.save_pretrained(str(tmp_path))
    loaded = load_model(str(tmp_path), dtype=dtype)
    assert loaded.model.own_layers[0].self_attn.whole_rotary and layer_weights(loaded.model) is not None
    prompts = _prompts(hf.config.vocab_size)[:4]
    fused, per_op, a, b, calls = fused_and_per_op(
        loaded.model, loaded.dtype, prompts, 12, monkeypatch, prefill_chunk=8, join_steps=[0, 2, 0, 5]
    )
    assert calls >= 8
    assert_same_steps(fused, per_op, a, b)
    if dtype == "float32":
        for prompt, tokens in zip(prompts, fused.tokens):
            assert tokens == _transformers_greedy(hf, prompt, 12)[0]


def test_native_fused_decode_never_serves_a_partial_rotary() -> None:
    from transformers import LlamaConfig

    configs = _tiny_configs()
    whole = configs["llama3"]
    partial = LlamaConfig(**{**whole.to_dict(), "partial_rotary_factor": 0.5})
    for config, served in ((whole, True), (partial, False)):
        with torch.device("cpu"):
            model = model_class(config)(config).float().eval()
        assert model.own_layers[0].self_attn.whole_rotary is served
        if not served:
            assert layer_weights(model) is None


def test_the_refused_features() -> None:
    """What each family is not served with; everything else is (tensor and pipeline parallelism:
    `test_split_over_ranks_gives_the_logits_of_one`; LoRA: `test_lora_adapters_equal_peft`;
    quantized weights: `test_quantized_checkpoints_equal_transformers_dequantized`)."""
    refused = {name: set(model_class(config).refused) for name, config in _tiny_configs().items()}
    assert refused == {
        "llama3": set(),
        "qwen3": set(),
        "qwen2": set(),
        "mistral": set(),
        "phi3": {LORA, QUANTIZED, EAGLE},
        "granite": {EAGLE},
        "olmo2": {EAGLE},
        "glm4": {QUANTIZED, EAGLE},
    }


@pytest.mark.parametrize("name", FAMILIES)
def test_refused_features_fail_at_their_start_naming_the_family(name: str, tiny_checkpoints: dict[str, Any]) -> None:
    tiny = tiny_checkpoints[name]
    cls = model_class(tiny.hf.config)
    loaded = load_model(str(tiny.path), dtype="float32")
    starts = {
        TENSOR_PARALLEL: lambda: cls(loaded.config, parallel=TensorParallel(rank=0, size=2)),
        QUANTIZED: lambda: load_model(str(tiny.path), dtype="float32", quantization="fp8"),
        LORA: lambda: AdapterSlots(
            loaded.model,
            max_loras=1,
            max_cpu_loras=1,
            limits=LoRALimits(),
            shapes=ModelShapes.of_config(loaded.config),
            dtype=torch.float32,
            device=torch.device("cpu"),
        ),
        EAGLE: lambda: load_eagle_head(str(tiny.path), loaded.model, torch.float32, torch.device("cpu")),
    }
    for feature, reason in cls.refused.items():
        with pytest.raises(ModelLoadError, match=re.escape(f"{cls.__name__} is not served with {feature}: {reason}")):
            starts[feature]()


@pytest.mark.parametrize(
    ("tp", "pp", "names"),
    [(2, 1, FAMILIES), (1, 2, FAMILIES), (4, 1, ("olmo2",))],
    ids=["tp2", "pp2", "tp4-olmo2"],
)
def test_split_over_ranks_gives_the_logits_of_one(
    tp: int, pp: int, names: tuple[str, ...], tiny_checkpoints: dict[str, Any], rank_pool: RankPool, tmp_path: Path
) -> None:
    """Real gloo groups (tests/models/test_parallel.py): Phi-3's fused checkpoint tensors shard as
    their parts, Granite's o_proj bias is added once, GLM-4's extra norms follow the all-reduce,
    OLMo 2's q/k norms sum their squares over the ranks (at 4 ranks each of its 2 KV heads is on
    two of them), the stages pass OLMo 2's post-normed residual stream on."""
    sources = [str(tiny_checkpoints[n].path) for n in names]
    got = _group_logits(rank_pool, tp, pp, sources, tmp_path / "logits.pt")
    parallel_rank.assert_ranks_give_one(sources, got, PARALLEL_ATOL, (tp, pp))


def test_fused_checkpoint_tensors_of_the_wrong_size_are_refused(
    tiny_checkpoints: dict[str, Any], tmp_path: Path
) -> None:
    """Phi-3 stores q/k/v as one qkv_proj: one of another size is a clear error, not a partial load."""
    from safetensors.torch import load_file, save_file

    src = tiny_checkpoints["phi3"].path
    dst = tmp_path / "phi3"
    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    name = "model.layers.0.self_attn.qkv_proj.weight"
    weights[name] = weights[name][:-16]
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    assert json.loads((dst / "config.json").read_text())["architectures"] == ["Phi3ForCausalLM"]
    with pytest.raises(ModelLoadError, match=f"weight {name} has 112 rows, the model expects 128"):
        load_model(str(dst), dtype="float32")


@pytest.mark.anyio
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name", ["granite", "olmo2", "glm4"])
async def test_lora_adapters_equal_peft(
    name: str, engine_checkpoints: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    """A rank-8 adapter built with peft, batched with the base model: Granite's on every projection
    (its multipliers scale the adapted outputs as peft's), OLMo 2's too (its q/k norms follow the
    adapted projections), GLM-4's on q/k/v/o and down_proj (an
    adapter of its fused gate_up_proj is refused by the adapter reader, naming the projections)."""
    path, hf = engine_checkpoints[name]
    targets = ALL_MODULES if name != "glm4" else ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]
    built = make_adapter(hf, tmp_path / "adapter", seed=3, b_scale=1.0, target_modules=targets)
    prompts = _prompts(hf.config.vocab_size)[:3]
    params = sonar.SamplingParams(max_tokens=LORA_TOKENS, temperature=0, ignore_eos=True, logprobs=3)
    async with sonar.open(
        str(path), dtype="float32", enable_lora=True, max_loras=1, lora_modules=[f"a={built.path}"]
    ) as llm:
        outs: dict[tuple[str | None, int], Any] = {}

        async def one(lora: str | None, i: int) -> None:
            outs[(lora, i)] = await llm.generate(prompts[i], params, lora=lora)

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                for lora in (None, "a"):
                    tg.start_soon(one, lora, i)
    for lora, adapter in ((None, None), ("a", built.path)):
        tokens, logits = peft_greedy(hf, adapter, prompts, LORA_TOKENS)
        for i in range(len(prompts)):
            out = outs[(lora, i)]
            assert out.token_ids == tokens[i], (lora, i)
            logprobs = torch.log_softmax(logits[i], dim=-1)[torch.arange(LORA_TOKENS), tokens[i]]
            torch.testing.assert_close(torch.tensor([p.logprob for p in out.logprobs]), logprobs, atol=1e-4, rtol=0)
    assert outs[(None, 1)].token_ids != outs[("a", 1)].token_ids
    if name == "glm4":
        fused = make_adapter(hf, tmp_path / "fused", seed=4, target_modules=["gate_up_proj"])
        with pytest.raises(LoRAError, match=r"gate_up_proj\.lora_[AB]\.weight' is not a LoRA factor of a supported"):
            read_adapter(fused.path, ModelShapes.of_config(hf.config), LoRALimits())


@pytest.mark.parametrize("case", ["gptq-int4-act-order-v1", "awq"])
@pytest.mark.parametrize("name", ["granite", "olmo2"])
def test_quantized_checkpoints_equal_transformers_dequantized(
    name: str, case: str, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """Granite's and OLMo 2's linear layers quantized in the test (tests/models/quantization), served
    as quantized layers, against transformers holding the dequantized weights (float32, 1e-4)."""
    extra = GRANITE_SCALARS if name == "granite" else {}
    architecture = model_class(_tiny_configs()[name]).__name__
    hf, _ = quantized_tiny(tmp_path_factory, architecture, model_type=name, **extra)
    quantize, qc, with_lm_head = QUANT_CASES[case]
    dequantized = write_quantized(hf, tmp_path / case, quantize, qc, with_lm_head)
    # the loader takes it (float32 on the CPU: served dequantized, exactly) ...
    assert load_model(str(tmp_path / case), dtype="float32").architecture == architecture
    # ... and its quantized layers compute transformers' logits
    model = load_quantized(tmp_path / case)
    quantized = {n for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert len(quantized) == 4 * hf.config.num_hidden_layers
    compare_quantized(model, quantized_reference(hf, dequantized))

"""GPT-OSS as a tiny random-weight transformers checkpoint, through the Sonar loader and model
against transformers' own implementation (eager attention, the one with sinks): greedy tokens
equal, logits within 1e-4 in float32, also with chunked prefills next to decodes, and through the
whole engine (`sonar.open`: a small KV pool, a token budget that chunks prompts, a prefix-cache
hit). The config makes every GPT-OSS feature count: a sliding window shorter than the prompts,
alternating with full layers; YaRN rope; non-zero sinks; biased router and experts whose gate/up
values reach the SwiGLU clamps. What Sonar does not serve for it is refused, naming it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import sonar
from sonar.lora.limits import LoRALimits, ModelShapes
from sonar.lora.slots import AdapterSlots
from sonar.models.eagle import load_eagle_head
from sonar.models.errors import ModelLoadError
from sonar.models.fused import layer_weights
from sonar.models.gpt_oss import GptOssForCausalLM
from sonar.models.loader import load_model
from sonar.models.parallel import PipelineStage, TensorParallel
from tests.engine.conftest import save_word_tokenizer
from tests.models.against import (
    assert_greedy_equals_transformers,
    assert_mixed_batch_equals_plain_batch,
    transformers_greedy,
)
from tests.models.driver import GreedyDriver

NEW_TOKENS = 20
WINDOW = 8


def tiny_config(**changes: Any) -> Any:
    from transformers import GptOssConfig

    return GptOssConfig(
        **{
            **dict(
                vocab_size=384,
                hidden_size=64,
                intermediate_size=48,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                num_local_experts=4,
                num_experts_per_tok=2,
                sliding_window=WINDOW,
                max_position_embeddings=256,
                rope_parameters={
                    "rope_type": "yarn",
                    "rope_theta": 150000.0,
                    "factor": 8.0,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                    "truncate": False,
                    "original_max_position_embeddings": 32,
                },
                eos_token_id=None,
                bos_token_id=None,
                pad_token_id=0,
                architectures=["GptOssForCausalLM"],
            ),
            **changes,
        }
    )


def _hf(config: Any, seed: int) -> Any:
    """transformers' model of `config` with weights wide enough that greedy choices are not near
    ties, sinks around the scores' size, and expert weights that push gate/up past the clamp."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
            elif name.endswith("sinks"):
                param.copy_(1.0 + torch.randn_like(param))
            elif name.endswith("experts.gate_up_proj"):
                param.copy_(torch.randn_like(param))
            else:
                param.copy_(0.15 * torch.randn_like(param))
    return hf


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("gpt_oss")
    hf = _hf(tiny_config(), seed=0)
    hf.save_pretrained(str(path))
    save_word_tokenizer(path, hf.config.vocab_size)
    return path, hf


@pytest.fixture(scope="module")
def loaded(checkpoint: tuple[Path, Any]) -> Any:
    return load_model(str(checkpoint[0]), dtype="float32")


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in (3, 17, 40, 9)]


def test_loads_as_its_architecture(loaded: Any) -> None:
    model = loaded.model
    assert loaded.architecture == "GptOssForCausalLM"
    assert [layer.self_attn.sliding_window for layer in model.own_layers] == [WINDOW, None, WINDOW, None]
    assert layer_weights(model) is None, "the native Llama layer loop must not serve GPT-OSS"


def test_a_warm_start_from_the_cached_config_builds_the_same_model(checkpoint: tuple[Path, Any]) -> None:
    """The config cache (a warm start reads no transformers config) keeps every field GPT-OSS
    reads, the ones outside `config_cache.READ` (``swiglu_limit``, ``swiglu_alpha``) included."""
    from transformers import AutoConfig

    from sonar.models import config_cache

    path, _ = checkpoint
    text = (path / "config.json").read_bytes()
    real = AutoConfig.from_pretrained(str(path))
    config_cache.write(text, real)
    cached = config_cache.read(text)
    assert isinstance(cached, config_cache.CachedConfig)
    for field in ("swiglu_limit", "swiglu_alpha", "layer_types", "sliding_window", "rope_parameters"):
        assert getattr(cached, field) == getattr(real, field), field
    warm = load_model(str(path), dtype="float32")
    assert isinstance(warm.config, config_cache.CachedConfig)
    block = warm.model.own_layers[0].mlp
    assert (block.limit, block.alpha, block.top_k) == (real.swiglu_limit, real.swiglu_alpha, real.num_experts_per_tok)


def test_the_clamps_bite(checkpoint: tuple[Path, Any]) -> None:
    """The experts' gate/up products pass the SwiGLU limit on the test prompts."""
    _, hf = checkpoint
    seen = []
    experts = hf.model.layers[0].mlp.experts
    handle = experts.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    with torch.no_grad():
        hf(torch.tensor([_prompts(384)[2]]))
        handle.remove()
        gate_up = seen[0] @ experts.gate_up_proj[0] + experts.gate_up_proj_bias[0]
    assert gate_up.abs().max() > 2 * experts.limit


def test_greedy_tokens_and_logits_equal_transformers(checkpoint: tuple[Path, Any], loaded: Any) -> None:
    _, hf = checkpoint
    assert_greedy_equals_transformers(loaded.model, hf, _prompts(loaded.config.vocab_size), NEW_TOKENS)


def test_mixed_batch_equals_plain_batch(loaded: Any) -> None:
    """Chunked prefills (chunks shorter than the window) next to decodes, staggered joins."""
    assert_mixed_batch_equals_plain_batch(loaded.model, _prompts(loaded.config.vocab_size), NEW_TOKENS)


def test_bfloat16_strays_no_further_than_transformers(checkpoint: tuple[Path, Any]) -> None:
    """The native bfloat16 path (sinks kept in bfloat16, read as float32 by the kernel; experts
    rounded op by op). This model's wide experts make bfloat16 flip some routing choices, so its
    prompt logits move from float32's in transformers too: Sonar's may move no further (within 1.5x)."""
    import copy

    _, hf = checkpoint
    hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)
    prompts = _prompts(384)[1:3]
    runs = {}
    for dtype in ("float32", "bfloat16"):
        loaded = load_model(str(checkpoint[0]), dtype=dtype)
        runs[dtype] = GreedyDriver(loaded.model, loaded.dtype, num_blocks=64, block_size=4).generate(
            prompts, 1, prompt_logits=True
        )
    for i, prompt in enumerate(prompts):
        with torch.inference_mode():
            want, want_bf16 = (m(torch.tensor([prompt])).logits[0].float() for m in (hf, hf_bf16))
        theirs = (want_bf16 - want).abs().max()
        ours = (runs["bfloat16"].prompt_logits[i] - runs["float32"].prompt_logits[i]).abs().max()
        assert ours <= 1.5 * theirs + 1e-2, f"prompt {i}: {ours} vs transformers' {theirs}"


@pytest.mark.parametrize("change", ["sinks", "window"])
def test_the_sinks_and_the_window_change_the_output(checkpoint: tuple[Path, Any], change: str) -> None:
    """The tiny model exercises what it claims to: transformers' logits on the same weights move
    without the sinks (all -inf) or without the window."""
    from transformers import AutoModelForCausalLM

    _, hf = checkpoint
    config = tiny_config(sliding_window=256) if change == "window" else hf.config
    other = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    other.load_state_dict(hf.state_dict())
    if change == "sinks":
        with torch.no_grad():
            for layer in other.model.layers:
                layer.self_attn.sinks.fill_(float("-inf"))
    prompt = torch.tensor([_prompts(384)[2]])
    with torch.inference_mode():
        assert (other(prompt).logits - hf(prompt).logits).abs().max() > 1e-2


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_engine_greedy_equals_transformers(checkpoint: tuple[Path, Any], anyio_backend: str) -> None:
    """Through `sonar.open`: batched, chunked (a 32-token budget) and from the prefix cache."""
    path, hf = checkpoint
    prompts = _prompts(384) + [_prompts(384)[2]]  # the last one repeats a prompt: a prefix-cache hit
    params = sonar.SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    async with sonar.open(
        str(path), dtype="float32", num_gpu_blocks_override=64, max_num_batched_tokens=32, max_num_seqs=8
    ) as llm:
        outs = await llm.generate_many(prompts, params)
        assert llm.info.architecture == "GptOssForCausalLM"
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == transformers_greedy(hf, prompt, NEW_TOKENS)[0]


# -- what Sonar refuses for GPT-OSS --------------------------------------------------------------


def _with_config(path: Path, tmp_path: Path, **changes: Any) -> Path:
    out = tmp_path / "changed"
    out.mkdir()
    for f in path.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f)
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_quantization_methods_other_than_mxfp4_are_refused_naming_them(
    checkpoint: tuple[Path, Any], tmp_path: Path
) -> None:
    """MXFP4 checkpoints are served (tests/models/quantization/test_mxfp4.py); one that declares
    mxfp4 but stores no expert quantized is refused, and so is any other method."""
    mxfp4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    path = _with_config(checkpoint[0], tmp_path, quantization_config=mxfp4)
    with pytest.raises(ModelLoadError, match="quantization method mxfp4, but the checkpoint stores no layer quantized"):
        load_model(str(path), dtype="float32")
    with pytest.raises(ModelLoadError, match="GptOssForCausalLM: quantization_config quant_method 'gptq'"):
        GptOssForCausalLM(tiny_config(quantization_config={"quant_method": "gptq", "bits": 4}))


def test_parallelism_and_quantization_are_refused(checkpoint: tuple[Path, Any]) -> None:
    path = str(checkpoint[0])
    with pytest.raises(ModelLoadError, match="GptOssForCausalLM is not served with quantized weights"):
        load_model(path, dtype="float32", quantization="fp8")
    with pytest.raises(ModelLoadError, match="GptOssForCausalLM is not served with tensor parallelism"):
        load_model(path, dtype="float32", parallel=TensorParallel(rank=0, size=2))
    config = tiny_config()
    with pytest.raises(ModelLoadError, match="GptOssForCausalLM is not served with pipeline parallelism"):
        GptOssForCausalLM(config, stage=PipelineStage(index=0, size=2).resolve(config.num_hidden_layers))


def test_lora_and_eagle_are_refused(loaded: Any, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="GptOssForCausalLM is not served with LoRA adapters"):
        AdapterSlots(
            loaded.model,
            max_loras=1,
            max_cpu_loras=1,
            limits=LoRALimits(),
            shapes=ModelShapes.of_config(loaded.config),
            dtype=torch.float32,
            device=torch.device("cpu"),
        )
    with pytest.raises(ModelLoadError, match="GptOssForCausalLM is not served with EAGLE"):
        load_eagle_head(str(tmp_path), loaded.model, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize(
    ("changes", "message"),
    [({"hidden_act": "gelu"}, "hidden_act"), ({"layer_types": ["sliding_attention"] * 3}, "layer_types")],
)
def test_config_features_sonar_does_not_serve_are_refused(changes: dict[str, Any], message: str) -> None:
    config = tiny_config()
    for key, value in changes.items():
        setattr(config, key, value)
    with pytest.raises(ModelLoadError, match=message):
        GptOssForCausalLM(config)

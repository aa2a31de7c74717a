"""Gemma, Gemma 2 and Gemma 3 (text) as tiny random-weight transformers checkpoints, through the
Sonar loader and model against transformers' own implementation (eager attention: the one that
soft-caps): greedy tokens equal, logits within 1e-4 in float32, also with chunked prefills next to
decodes. The configs make every Gemma feature count: a sliding window shorter than the prompts,
``head_dim`` decoupled from ``hidden_size / heads``, ``query_pre_attn_scalar`` apart from
``head_dim``, attention (Gemma 2) and final logit soft-capping at values the scores reach, Gemma
3's per-kind rope (linear-scaled global, a different local base). And what Sonar does not serve
for them is refused, naming it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from sonar.kernels.attention import AttentionMetadata, allocate_kv_caches
from sonar.lora.limits import LoRALimits, ModelShapes
from sonar.lora.slots import AdapterSlots
from sonar.models.eagle import load_eagle_head
from sonar.models.errors import ModelLoadError
from sonar.models.fused import layer_weights
from sonar.models.gemma import FULL, SLIDING, Gemma2ForCausalLM, Gemma3ForCausalLM
from sonar.models.loader import load_model
from sonar.models.parallel import PipelineStage, TensorParallel
from sonar.models.registry import model_class
from tests.models.against import assert_greedy_equals_transformers, assert_mixed_batch_equals_plain_batch

NEW_TOKENS = 20
WINDOW = 8
COMMON = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=0,
)


def tiny_configs() -> dict[str, Any]:
    from transformers import Gemma2Config, Gemma3TextConfig, GemmaConfig

    return {
        "gemma": GemmaConfig(**COMMON, architectures=["GemmaForCausalLM"]),
        # layers alternate sliding (0, 2) and global (1, 3); caps of 5 and 10: the scores pass them
        "gemma2": Gemma2Config(
            **COMMON,
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=10.0,
            architectures=["Gemma2ForCausalLM"],
        ),
        "gemma3": Gemma3TextConfig(
            **COMMON,
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,
            final_logit_softcapping=10.0,
            layer_types=[SLIDING, SLIDING, FULL, SLIDING],
            rope_parameters={
                SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                FULL: {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
            },
            architectures=["Gemma3ForCausalLM"],
        ),
    }


def save_tiny(config: Any, path: Path, seed: int) -> Any:
    """A transformers model of `config` with weights spread wide enough that greedy choices are
    not near-ties (Gemma norms scale by ``1 + weight``: norm weights around 0), saved to `path`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            param.copy_((0.2 if name.endswith("norm.weight") else 0.15) * torch.randn_like(param))
    hf.save_pretrained(str(path))
    return hf


@pytest.fixture(scope="module")
def tiny_gemmas(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    out = {}
    for i, (name, config) in enumerate(tiny_configs().items()):
        path = tmp_path_factory.mktemp(name)
        out[name] = (path, save_tiny(config, path, seed=i))
    return out


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in (3, 17, 40, 9)]


@pytest.fixture(scope="module", params=list(tiny_configs()))
def case(request: pytest.FixtureRequest, tiny_gemmas: dict[str, tuple[Path, Any]]) -> tuple[Any, Any]:
    path, hf = tiny_gemmas[request.param]
    return hf, load_model(str(path), dtype="float32")


def test_loads_as_its_architecture(case: Any) -> None:
    hf, loaded = case
    assert loaded.architecture == type(hf).__name__
    assert loaded.model.tie_word_embeddings
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    assert layer_weights(loaded.model) is None, "the native Llama layer loop must not serve Gemma"


def test_greedy_tokens_and_logits_equal_transformers(case: Any) -> None:
    hf, loaded = case
    assert_greedy_equals_transformers(loaded.model, hf, _prompts(loaded.config.vocab_size), NEW_TOKENS)


def test_mixed_batch_equals_plain_batch(case: Any) -> None:
    """Chunked prefills (chunks shorter than the window) next to decodes, staggered joins."""
    _, loaded = case
    assert_mixed_batch_equals_plain_batch(loaded.model, _prompts(loaded.config.vocab_size), NEW_TOKENS)


@torch.inference_mode()
def test_given_rows_are_transformers_input_embeddings(case: Any) -> None:
    """`forward_rows` (image features, prompts given as embeddings) takes the first layer's input
    as transformers' embedding layer gives it, already scaled by sqrt(hidden_size): the logits
    equal transformers' for ``inputs_embeds``, with half the rows given and half from token ids."""
    hf, loaded = case
    model = loaded.model
    prompt = _prompts(loaded.config.vocab_size)[2]
    embeds = hf.get_input_embeddings()(torch.tensor([prompt]))
    want = hf(inputs_embeds=embeds).logits[0]
    caches = allocate_kv_caches(model.num_layers, 32, 4, model.num_kv_heads, model.head_dim, torch.float32)
    meta = AttentionMetadata.build([len(prompt)], [len(prompt)], [list(range(10))], 4)
    rows = torch.arange(0, len(prompt), 2)
    ids = torch.tensor(prompt)
    ids[rows] = 0  # the given rows' token ids must not matter
    hidden = model.forward_rows(ids, torch.arange(len(prompt)), caches, meta, rows, embeds[0, rows])
    torch.testing.assert_close(model.compute_logits(hidden), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "change", [{"attn_logit_softcapping": None}, {"final_logit_softcapping": None}, {"sliding_window": 64}]
)
def test_the_caps_and_the_window_change_the_output(
    tiny_gemmas: dict[str, tuple[Path, Any]], change: dict[str, Any]
) -> None:
    """The tiny Gemma 2 exercises what it claims to: transformers' logits on the same weights move
    without its attention cap, its final cap or its window."""
    from transformers import AutoModelForCausalLM

    _, hf = tiny_gemmas["gemma2"]
    config = type(hf.config).from_dict({**hf.config.to_dict(), **change})
    other = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    other.load_state_dict(hf.state_dict())
    prompt = torch.tensor([_prompts(COMMON["vocab_size"])[2]])
    with torch.inference_mode():
        assert (other(prompt).logits - hf(prompt).logits).abs().max() > 1e-2


def _with_config(path: Path, tmp_path: Path, **changes: Any) -> Path:
    """A copy of the checkpoint at `path` whose config.json has `changes` applied."""
    out = tmp_path / "changed"
    out.mkdir()
    for f in path.iterdir():
        (out / f.name).symlink_to(f)
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (out / "config.json").unlink()
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize(
    ("name", "changes", "message"),
    [
        ("gemma3", {"attn_logit_softcapping": 20.0}, "attn_logit_softcapping"),
        ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ("gemma2", {"hidden_activation": "silu"}, "hidden_activation"),
    ],
)
def test_config_features_sonar_does_not_serve_are_refused(
    tiny_gemmas: dict[str, tuple[Path, Any]], tmp_path: Path, name: str, changes: dict[str, Any], message: str
) -> None:
    path = _with_config(tiny_gemmas[name][0], tmp_path, **changes)
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(path), dtype="float32")


def test_parallelism_and_quantization_are_refused(tiny_gemmas: dict[str, tuple[Path, Any]]) -> None:
    path = str(tiny_gemmas["gemma2"][0])
    with pytest.raises(ModelLoadError, match="Gemma2ForCausalLM is not served with quantized weights"):
        load_model(path, dtype="float32", quantization="fp8")
    with pytest.raises(ModelLoadError, match="Gemma2ForCausalLM is not served with tensor parallelism"):
        load_model(path, dtype="float32", parallel=TensorParallel(rank=0, size=2))
    config = tiny_configs()["gemma3"]
    with pytest.raises(ModelLoadError, match="Gemma3ForCausalLM is not served with pipeline parallelism"):
        Gemma3ForCausalLM(config, stage=PipelineStage(index=0, size=2).resolve(config.num_hidden_layers))


def test_lora_and_eagle_are_refused(case: Any, tmp_path: Path) -> None:
    hf, loaded = case
    model = loaded.model
    with pytest.raises(ModelLoadError, match="ForCausalLM is not served with LoRA adapters"):
        AdapterSlots(
            model,
            max_loras=1,
            max_cpu_loras=1,
            limits=LoRALimits(),
            shapes=ModelShapes.of_config(loaded.config),
            dtype=torch.float32,
            device=torch.device("cpu"),
        )
    with pytest.raises(ModelLoadError, match="ForCausalLM is not served with EAGLE"):
        load_eagle_head(str(tmp_path), model, torch.float32, torch.device("cpu"))


def test_multimodal_gemma3_is_its_own_architecture() -> None:
    """Gemma 3's vision-language checkpoints (``Gemma3ForConditionalGeneration``) get the class
    with the vision tower (`sonar.models.gemma3_vl`, tested in test_gemma3_vl.py), not the text one."""
    from sonar.models.gemma3_vl import Gemma3ForConditionalGeneration

    assert (
        model_class({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"})
        is Gemma3ForConditionalGeneration
    )
    assert model_class({"architectures": ["Gemma2ForCausalLM"]}) is Gemma2ForCausalLM


def test_older_gemma3_config_fields_give_transformers_layers_and_rope() -> None:
    """A Gemma 3 config as older transformers stored it (``sliding_window_pattern``,
    ``rope_theta`` + ``rope_scaling`` for global layers, ``rope_local_base_freq`` for sliding ones;
    no ``layer_types``, no per-kind ``rope_parameters``) gives the layer kinds and rotary
    frequencies transformers derives from the same fields."""
    from types import SimpleNamespace

    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    from sonar.models.gemma import GemmaSpec, LayerRotary, rope_by_kind

    old = dict(
        COMMON,
        num_hidden_layers=7,
        sliding_window=WINDOW,
        sliding_window_pattern=3,
        rope_theta=500_000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        rope_local_base_freq=20_000.0,
    )
    hf_config = Gemma3TextConfig(**old)
    spec = GemmaSpec(SimpleNamespace(**old), 32, generation=3)
    assert list(spec.layer_kinds) == hf_config.layer_types
    rotary = LayerRotary(rope_by_kind(SimpleNamespace(**old), spec.layer_kinds), 32, 256)
    hf_rotary = Gemma3RotaryEmbedding(hf_config)
    for kind in (SLIDING, FULL):
        torch.testing.assert_close(rotary.by_kind[kind].inv_freq, getattr(hf_rotary, f"{kind}_inv_freq"))

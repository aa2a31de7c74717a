"""The EAGLE head against a reference built from transformers' own Llama modules, and its drafts
through the model runner.

The reference is what EAGLE-1 defines (and vLLM's `EagleLlamaForCausalLM` runs): a transformers
`LlamaModel` of the head's config whose first layer has no input norm and which has no final norm,
fed ``fc(cat(embed(token p + 1), target_hidden(p)))``; the target's LM head gives the logits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from sonar.core.outputs import ScheduledRequest, SchedulerOutput
from sonar.engine.config import EngineConfig
from sonar.engine.runner import ModelRunner
from sonar.models.eagle import load_eagle_head
from sonar.models.errors import ModelLoadError
from sonar.protocol.engine import ExecuteStep, NewRequestData
from sonar.sampling_params import SamplingParams
from tests.engine.conftest import TinyCheckpoint, save_word_tokenizer, spread_weights
from tests.models.conftest import _tiny_configs

K = 3


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoint:
    """The tiny Llama of the model tests (Llama 3 rope scaling: the head inherits it)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(5)
    config = _tiny_configs()["llama3"]
    hf = LlamaForCausalLM(config).eval()
    spread_weights(hf)
    path = tmp_path_factory.mktemp("eagle-target")
    hf.save_pretrained(str(path))
    save_word_tokenizer(path, config.vocab_size)
    return TinyCheckpoint("llama", path, hf)


def reference_head(target: TinyCheckpoint, fc_bias: bool) -> tuple[Any, nn.Linear]:
    """A random EAGLE head as transformers modules: (the layer stack, fc)."""
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(**{**target.hf.config.to_dict(), "num_hidden_layers": 1})
    torch.manual_seed(6)
    stack = LlamaModel(config).eval()
    spread_weights(stack)
    stack.layers[0].input_layernorm = nn.Identity()
    stack.norm = nn.Identity()
    fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=fc_bias)
    nn.init.normal_(fc.weight, std=0.1)
    return stack, fc


def save_head(path: Path, stack: Any, fc: nn.Linear, prefix: str = "") -> None:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    tensors = {
        f"{prefix}{name}": t.contiguous() for name, t in stack.state_dict().items() if name.startswith("layers.")
    }
    tensors.update({f"{prefix}fc.{name}": t.contiguous() for name, t in fc.state_dict().items()})
    save_file(tensors, str(path / "model.safetensors"))
    config = {**stack.config.to_dict(), "architectures": ["EAGLEModel"]}
    (path / "config.json").write_text(json.dumps(config))


@torch.no_grad()
def reference_logits(
    target: TinyCheckpoint, stack: Any, fc: nn.Linear, tokens: list[int], next_ids: list[int]
) -> torch.Tensor:
    """The head's logits at positions 0.. of `tokens` (each beside the token after it, `next_ids`)."""
    hf = target.hf
    features = hf.model(torch.tensor([tokens])).last_hidden_state[0]
    x = fc(torch.cat((hf.model.embed_tokens(torch.tensor(next_ids)), features[: len(next_ids)]), dim=-1))
    out = stack(inputs_embeds=x[None]).last_hidden_state[0]
    return hf.lm_head(out)


@pytest.mark.parametrize("fc_bias", [False, True])
def test_the_head_matches_the_transformers_reference(target: TinyCheckpoint, tmp_path: Path, fc_bias: bool) -> None:
    from sonar.kernels.attention import AttentionMetadata, allocate_kv_caches
    from sonar.models.loader import load_model

    stack, fc = reference_head(target, fc_bias)
    save_head(tmp_path / "head", stack, fc, prefix="model." if fc_bias else "")
    loaded = load_model(str(target.path), dtype="float32")
    head = load_eagle_head(str(tmp_path / "head"), loaded.model, torch.float32, torch.device("cpu"))
    tokens = [5, 17, 3, 88, 41, 9, 60, 2, 33, 71]
    next_ids = tokens[1:] + [12]
    n = len(tokens)
    meta = AttentionMetadata.build([n], [n], [[0]], 16)
    features = loaded.model(
        torch.tensor(tokens), torch.arange(n), allocate_kv_caches(2, 2, 16, 2, 16, torch.float32, "cpu"), meta
    )
    caches = allocate_kv_caches(1, 2, 16, head.num_kv_heads, head.head_dim, torch.float32, "cpu")
    with torch.no_grad():
        got = head.compute_logits(head(torch.tensor(next_ids), torch.arange(n), features, caches, meta))
    want = reference_logits(target, stack, fc, tokens, next_ids)
    torch.testing.assert_close(got, want.float(), atol=1e-4, rtol=1e-4)


def test_bad_heads_are_refused(target: TinyCheckpoint, tmp_path: Path) -> None:
    from sonar.models.loader import load_model

    loaded = load_model(str(target.path), dtype="float32")
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "config.json").write_text("{}")
    (tmp_path / "pickled" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="unpickling runs code"):
        load_eagle_head(str(tmp_path / "pickled"), loaded.model, torch.float32, torch.device("cpu"))
    stack, fc = reference_head(target, False)
    save_head(tmp_path / "nofc", stack, nn.Linear(2 * 64, 64, bias=False))
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "nofc" / "model.safetensors"))
    del tensors["fc.weight"]
    save_file(tensors, str(tmp_path / "nofc" / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="missing weights"):
        load_eagle_head(str(tmp_path / "nofc"), loaded.model, torch.float32, torch.device("cpu"))


def test_the_runner_drafts_what_the_reference_head_predicts(target: TinyCheckpoint, tmp_path: Path) -> None:
    """One prefill step through the runner: its target token, then K drafts, each the reference
    head's argmax over the head's own outputs (the positions line up: token p + 1 beside
    hidden p, drafts fed back with the head's output)."""
    stack, fc = reference_head(target, False)
    save_head(tmp_path / "head", stack, fc)
    config = EngineConfig.from_args(
        str(target.path),
        dtype="float32",
        num_gpu_blocks_override=16,
        speculative_config={"method": "eagle", "model": str(tmp_path / "head"), "num_speculative_tokens": K},
    )
    runner = ModelRunner(config)
    prompt = [5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 14]
    params = SamplingParams(temperature=0, max_tokens=16)
    sched = ScheduledRequest("r", prompt, 0, [0], True, True, len(prompt))
    step = ExecuteStep(SchedulerOutput(0, [sched], len(prompt), [], []), [NewRequestData("r", params, prompt, [])])
    result = runner.execute(step)
    [token] = result.sampled["r"]
    with torch.no_grad():
        assert token == int(target.hf(torch.tensor([prompt])).logits[0, -1].argmax())
        hf = target.hf
        features = hf.model(torch.tensor([prompt])).last_hidden_state[0]
        ids = prompt[1:] + [token]
        embeds = hf.model.embed_tokens(torch.tensor(ids))
        x = fc(torch.cat((embeds, features), dim=-1))
        drafts = []
        for _ in range(K):
            out = stack(inputs_embeds=x[None]).last_hidden_state[0]
            draft = int(hf.lm_head(out[-1]).argmax())
            drafts.append(draft)
            nxt = fc(torch.cat((hf.model.embed_tokens(torch.tensor([draft])), out[-1:]), dim=-1))
            x = torch.cat((x, nxt))
    assert result.proposed["r"] == drafts


@pytest.mark.anyio
async def test_eagle_through_the_engine_keeps_greedy_output(target: TinyCheckpoint, tmp_path: Path, one_thread) -> None:
    """A random head guesses badly; the text is the plain engine's, and the head did draft."""
    import sonar

    stack, fc = reference_head(target, False)
    save_head(tmp_path / "head", stack, fc)
    prompts = ["w5 w17 w3 w88 w41 w9", "w60 w2 w33 w71 w14 w60 w2 w33", "w1 w2 w3"]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    common: dict[str, Any] = dict(dtype="float32", max_model_len=128, num_gpu_blocks_override=32, seed=0)
    async with sonar.open(str(target.path), **common) as plain:
        expected = [out.token_ids for out in await plain.generate_many(prompts, params)]
    config = {"method": "eagle", "model": str(tmp_path / "head"), "num_speculative_tokens": K}
    async with sonar.open(str(target.path), speculative_config=config, **common) as spec:
        got = [out.token_ids for out in await spec.generate_many(prompts, params)]
        stats = await spec.stats()
    assert got == expected
    assert stats.spec_num_draft_tokens > 0

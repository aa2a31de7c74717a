"""The EAGLE-3 head against a naive torch implementation of the paper's equations, its loading
from the published checkpoint format, and its drafts through the model runner.

The reference reads the target's layers from transformers (``output_hidden_states``: entry ``i``
is the residual stream entering layer ``i``) and computes the head by hand: ``fc`` over the three
layers, a layer whose attention reads ``[rms(embed(token p + 1)), rms(feature p)]``, the head's
norm and its draft-vocabulary LM head, ``d2t`` back to target ids.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from sonar.core.outputs import ScheduledRequest, SchedulerOutput
from sonar.engine.config import EngineConfig
from sonar.engine.runner import ModelRunner
from sonar.models.eagle3 import aux_layer_ids, load_eagle3_head
from sonar.models.errors import ModelLoadError
from sonar.protocol.engine import ExecuteStep, NewRequestData
from sonar.sampling_params import SamplingParams
from tests.engine.conftest import TinyCheckpoint, save_word_tokenizer, spread_weights

K = 3
VOCAB = 384
DRAFT_VOCAB = 96
HIDDEN = 64
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
LAYERS = 8  # low/mid/high: layers 2, 4, 5
EPS = 1e-6


def tiny_llama_config(layers: int = LAYERS, **changes: object):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=256,
        rms_norm_eps=EPS,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
        **changes,
    )


def make_target(path: Path, seed: int = 5, echo: bool = False) -> TinyCheckpoint:
    """A tiny random Llama; `echo`: its output projections zero, norms one and LM head tied, so
    it repeats its last token forever (the residual stream is that token's embedding throughout)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    hf = LlamaForCausalLM(tiny_llama_config(tie_word_embeddings=echo)).eval()
    spread_weights(hf)
    if echo:
        with torch.no_grad():
            for name, param in hf.named_parameters():
                if "o_proj" in name or "down_proj" in name:
                    param.zero_()
                elif name.endswith("norm.weight"):
                    param.fill_(1)
            embed = hf.model.embed_tokens.weight
            embed.copy_(embed / embed.norm(dim=-1, keepdim=True))  # equal norms: each row its own argmax
    hf.save_pretrained(str(path))
    save_word_tokenizer(path, VOCAB)
    return TinyCheckpoint("llama", path, hf)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoint:
    return make_target(tmp_path_factory.mktemp("eagle3-target"))


def random_head(seed: int = 6) -> dict[str, Tensor]:
    """A random EAGLE-3 head in the published tensor names (draft vocabulary: every fourth target id)."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> Tensor:
        return 0.15 * torch.randn(*shape, generator=g)

    def norm() -> Tensor:
        return 1 + 0.2 * torch.randn(HIDDEN, generator=g)

    draft_ids = torch.arange(DRAFT_VOCAB) * 4 + 1
    return {
        "fc.weight": w(HIDDEN, 3 * HIDDEN),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": w(HEADS * HEAD_DIM, 2 * HIDDEN),
        "midlayer.self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, 2 * HIDDEN),
        "midlayer.self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, 2 * HIDDEN),
        "midlayer.self_attn.o_proj.weight": w(HIDDEN, HEADS * HEAD_DIM),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.mlp.gate_proj.weight": w(128, HIDDEN),
        "midlayer.mlp.up_proj.weight": w(128, HIDDEN),
        "midlayer.mlp.down_proj.weight": w(HIDDEN, 128),
        "norm.weight": norm(),
        "lm_head.weight": w(DRAFT_VOCAB, HIDDEN),
        "d2t": draft_ids - torch.arange(DRAFT_VOCAB),
        "t2d": torch.zeros(VOCAB, dtype=torch.bool).index_fill(0, draft_ids, True),
    }


def echo_head(target: TinyCheckpoint) -> dict[str, Tensor]:
    """For an echo target (`make_target`): ``fc`` passes the highest layer through, the layer adds
    nothing, the LM head is the target's over the whole vocabulary: it predicts the token the
    target repeats, so every draft is right."""
    t = random_head()
    t["fc.weight"] = torch.cat((torch.zeros(HIDDEN, 2 * HIDDEN), torch.eye(HIDDEN)), dim=1)
    t["midlayer.self_attn.o_proj.weight"].zero_()
    t["midlayer.mlp.down_proj.weight"].zero_()
    t["norm.weight"] = torch.ones(HIDDEN)
    t["lm_head.weight"] = target.hf.lm_head.weight.detach().clone()
    t["d2t"] = torch.zeros(VOCAB, dtype=torch.long)
    t["t2d"] = torch.ones(VOCAB, dtype=torch.bool)
    return t


def save_head(path: Path, tensors: dict[str, Tensor], **config_changes: object) -> Path:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": 128,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": 1,
        "rms_norm_eps": EPS,
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
        "vocab_size": VOCAB,
        "draft_vocab_size": DRAFT_VOCAB,
        **config_changes,
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


# The paper's equations, by hand.


def rms(x: Tensor, w: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def rope(x: Tensor, positions: Tensor) -> Tensor:
    """Rotate ``[n, heads, d]`` by the default rotary (theta 10000, halves)."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    angles = positions.float()[:, None] * inv[None]
    cos, sin = torch.cat((angles, angles), -1).cos()[:, None], torch.cat((angles, angles), -1).sin()[:, None]
    half = HEAD_DIM // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
    return x * cos + rotated * sin


def naive_head(
    t: dict[str, Tensor], embeds: Tensor, features: Tensor, norm_before_residual: bool = False
) -> tuple[Tensor, Tensor]:
    """(draft-vocabulary logits, fed-back states) of a sequence at positions 0.. (causal)."""
    n = embeds.shape[0]
    normed = rms(features, t["midlayer.hidden_norm.weight"])
    x = torch.cat((rms(embeds, t["midlayer.input_layernorm.weight"]), normed), -1)
    pos = torch.arange(n)
    q = rope((x @ t["midlayer.self_attn.q_proj.weight"].T).view(n, HEADS, HEAD_DIM), pos)
    k = rope((x @ t["midlayer.self_attn.k_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM), pos)
    v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / HEAD_DIM**0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, HEADS * HEAD_DIM)
    residual = attn @ t["midlayer.self_attn.o_proj.weight"].T + (normed if norm_before_residual else features)
    h = rms(residual, t["midlayer.post_attention_layernorm.weight"])
    mlp = (F.silu(h @ t["midlayer.mlp.gate_proj.weight"].T) * (h @ t["midlayer.mlp.up_proj.weight"].T)) @ t[
        "midlayer.mlp.down_proj.weight"
    ].T
    out = mlp + residual
    return rms(out, t["norm.weight"]) @ t["lm_head.weight"].T, out


@torch.no_grad()
def target_features(target: TinyCheckpoint, t: dict[str, Tensor], tokens: list[int], layers=(2, 4, 5)) -> Tensor:
    states = target.hf.model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    return torch.cat([states[i][0] for i in layers], -1) @ t["fc.weight"].T


def to_target(t: dict[str, Tensor], draft_id: int) -> int:
    return draft_id + int(t["d2t"][draft_id])


def test_default_layers_are_low_mid_high_and_a_config_may_name_them() -> None:
    from types import SimpleNamespace

    assert aux_layer_ids(SimpleNamespace(), 32) == (2, 16, 29)
    assert aux_layer_ids(SimpleNamespace(eagle_aux_hidden_state_layer_ids=[5, 1, 3]), 8) == (1, 3, 5)
    nested = SimpleNamespace(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 6]})
    assert aux_layer_ids(nested, 8) == (1, 2, 6)
    assert aux_layer_ids(SimpleNamespace(eagle_aux_hidden_state_layer_ids=[0, 3, 7]), 8) == (0, 3, 7)
    with pytest.raises(ModelLoadError, match="three distinct target layers"):
        aux_layer_ids(SimpleNamespace(), 4)  # 2, 2, 1
    with pytest.raises(ModelLoadError, match=r"in 0\.\.7"):
        aux_layer_ids(SimpleNamespace(eagle_aux_hidden_state_layer_ids=[1, 2, 8]), 8)


@pytest.mark.parametrize(
    ("layers", "norm_before_residual"),
    [(None, False), ((0, 3, 7), False), (None, True)],
    ids=["default", "named-layers", "norm-before-residual"],
)
def test_the_head_matches_the_naive_equations(
    target: TinyCheckpoint, tmp_path: Path, layers: tuple[int, ...] | None, norm_before_residual: bool
) -> None:
    """The default layers (2, 4, 5 of 8), or those the config names (0: the embeddings); the
    residual the raw feature, or the normed one."""
    from sonar.kernels.attention import AttentionMetadata, allocate_kv_caches
    from sonar.models.loader import load_model

    t = random_head()
    loaded = load_model(str(target.path), dtype="float32")
    named: dict[str, object] = {"norm_before_residual": norm_before_residual}
    if layers is not None:
        named["eagle_aux_hidden_state_layer_ids"] = list(layers)
    path = save_head(tmp_path / "head", t, **named)
    head = load_eagle3_head(str(path), loaded.model, torch.float32, torch.device("cpu"))
    tokens = [5, 17, 3, 88, 41, 9, 60, 2, 33, 71]
    next_ids = tokens[1:] + [12]
    n = len(tokens)
    meta = AttentionMetadata.build([n], [n], [[0]], 16)
    caches = allocate_kv_caches(LAYERS, 2, 16, KV_HEADS, HEAD_DIM, torch.float32, "cpu")
    with torch.no_grad():
        loaded.model(torch.tensor(tokens), torch.arange(n), caches, meta)  # the hooks catch the layers
        features = head.target_features(torch.empty(0), torch.arange(n))
        head_caches = allocate_kv_caches(1, 2, 16, head.num_kv_heads, head.head_dim, torch.float32, "cpu")
        states, fed = head(torch.tensor(next_ids), torch.arange(n), features, head_caches, meta)
        got = head.compute_logits(states)
        want_logits, want_fed = naive_head(
            t,
            target.hf.model.embed_tokens(torch.tensor(next_ids)),
            target_features(target, t, tokens, layers or (2, 4, 5)),
            norm_before_residual,
        )
    torch.testing.assert_close(got, want_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fed, want_fed, atol=1e-4, rtol=1e-4)
    ids = head.greedy(states).tolist()
    assert ids == [to_target(t, int(d)) for d in want_logits.argmax(-1)]
    assert all(i % 4 == 1 for i in ids)  # every draft id lands on the target id d2t names


def test_bad_heads_are_refused(target: TinyCheckpoint, tmp_path: Path) -> None:
    from sonar.models.loader import load_model

    model = load_model(str(target.path), dtype="float32").model
    cpu = torch.device("cpu")
    t = random_head()
    without_d2t = {k: v for k, v in t.items() if k != "d2t"}
    with pytest.raises(ModelLoadError, match="needs d2t"):
        load_eagle3_head(str(save_head(tmp_path / "a", without_d2t)), model, torch.float32, cpu)
    with pytest.raises(ModelLoadError, match=r"missing weights \['fc.weight'\]"):
        load_eagle3_head(
            str(save_head(tmp_path / "b", {k: v for k, v in t.items() if k != "fc.weight"})), model, torch.float32, cpu
        )
    bad = {**t, "d2t": t["d2t"] + VOCAB}
    with pytest.raises(ModelLoadError, match="outside the target's vocabulary"):
        load_eagle3_head(str(save_head(tmp_path / "c", bad)), model, torch.float32, cpu)
    with pytest.raises(ModelLoadError, match="num_hidden_layers 2"):
        load_eagle3_head(str(save_head(tmp_path / "d", t, num_hidden_layers=2)), model, torch.float32, cpu)
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "config.json").write_text(json.dumps({"speculators_config": {"algorithm": "eagle3"}}))
    with pytest.raises(ModelLoadError, match="speculators format is not read"):
        load_eagle3_head(str(tmp_path / "f"), model, torch.float32, cpu)
    with pytest.raises(ModelLoadError, match="three distinct"):
        load_eagle3_head(
            str(save_head(tmp_path / "e", t, eagle_aux_hidden_state_layer_ids=[1, 1, 2])), model, torch.float32, cpu
        )


def test_the_runner_drafts_what_the_naive_head_predicts(target: TinyCheckpoint, tmp_path: Path) -> None:
    """One prefill step through the runner: its target token, then K drafts, each the naive head's
    argmax (mapped through d2t) over the head's own fed-back states."""
    t = random_head()
    head = save_head(tmp_path / "head", t)
    config = EngineConfig.from_args(
        str(target.path),
        dtype="float32",
        num_gpu_blocks_override=16,
        speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": K},
    )
    runner = ModelRunner(config)
    prompt = [5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 14]
    params = SamplingParams(temperature=0, max_tokens=16)
    sched = ScheduledRequest("r", prompt, 0, [0], True, True, len(prompt))
    step = ExecuteStep(SchedulerOutput(0, [sched], len(prompt), [], []), [NewRequestData("r", params, prompt, [])])
    result = runner.execute(step)
    [token] = result.sampled["r"]
    embed = target.hf.model.embed_tokens
    with torch.no_grad():
        assert token == int(target.hf(torch.tensor([prompt])).logits[0, -1].argmax())
        features = target_features(target, t, prompt)
        embeds = embed(torch.tensor(prompt[1:] + [token]))
        drafts = []
        for _ in range(K):
            logits, fed = naive_head(t, embeds, features)
            draft = to_target(t, int(logits[-1].argmax()))
            drafts.append(draft)
            embeds = torch.cat((embeds, embed(torch.tensor([draft]))))
            features = torch.cat((features, fed[-1:]))
    assert result.proposed["r"] == drafts

"""DeepSeek-V3's MTP layer against the equations of the DeepSeek-V3 report, with transformers'
own DeepSeek-V3 decoder layer as its block, and its drafts through the model runner.

The checkpoint is built the way the published ones are: a transformers DeepSeek-V3 of
``N + 1`` layers whose last layer becomes the MTP block ``model.layers.N.*``, beside random
``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.norm`` (and copies of the shared embeddings
and head), with ``num_hidden_layers: N`` and ``num_nextn_predict_layers: 1``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from sonar.core.outputs import ScheduledRequest, SchedulerOutput
from sonar.engine.config import EngineConfig
from sonar.engine.runner import ModelRunner
from sonar.models.deepseek_mtp import load_mtp_head
from sonar.models.errors import ModelLoadError
from sonar.protocol.engine import ExecuteStep, NewRequestData
from sonar.sampling_params import SamplingParams
from tests.engine.conftest import save_word_tokenizer

K = 3
N = 2  # main-model layers
EPS = 1e-6


def v3_config(layers: int, **changes: Any) -> Any:
    from transformers import DeepseekV3Config

    fields: dict[str, Any] = dict(
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
        q_lora_rank=24,
        max_position_embeddings=256,
        rms_norm_eps=EPS,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
        num_hidden_layers=layers,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        rope_interleave=True,
        architectures=["DeepseekV3ForCausalLM"],
    )
    fields.update(changes)
    return DeepseekV3Config(**fields)


class Mtp:
    """A target and its MTP layer as transformers modules: the full model of N + 1 layers, the
    target (its first N), the MTP block as a one-layer model without final norm, the MTP's own
    weights.

    `echo`: every layer's output projections zero, norms one and the LM head the embeddings, so
    the target repeats its last token forever, and ``eh_proj`` passes the target's state through:
    the MTP layer predicts that same token, and every draft is right."""

    def __init__(self, seed: int = 11, echo: bool = False) -> None:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        full = AutoModelForCausalLM.from_config(v3_config(N + 1), dtype=torch.float32).eval()
        with torch.no_grad():
            for name, param in full.named_parameters():
                if name.endswith("norm.weight"):
                    param.copy_(1 + 0.2 * torch.randn_like(param))
                else:
                    param.copy_(0.15 * torch.randn_like(param))
            for name, buffer in full.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buffer.copy_(0.3 * torch.randn_like(buffer))
            if echo:
                for name, param in full.named_parameters():
                    if "o_proj" in name or "down_proj" in name:
                        param.zero_()
                    elif name.endswith("norm.weight"):
                        param.fill_(1)
                embed = full.model.embed_tokens.weight
                embed.copy_(embed / embed.norm(dim=-1, keepdim=True))  # equal norms: each row its own argmax
                full.lm_head.weight.copy_(embed)
        self.state = {k: v.clone() for k, v in full.state_dict().items()}
        self.target = AutoModelForCausalLM.from_config(v3_config(N), dtype=torch.float32).eval()
        self.target.load_state_dict(
            {k: v for k, v in self.state.items() if not k.startswith(f"model.layers.{N}.")}, strict=True
        )
        # the block: layer N of the full model, alone (layer index N: a sparse layer), no final norm
        self.block = AutoModelForCausalLM.from_config(v3_config(1, first_k_dense_replace=0), dtype=torch.float32)
        self.block = self.block.model.eval()
        self.block.load_state_dict(
            {
                k.replace(f"model.layers.{N}.", "layers.0."): v
                for k, v in self.state.items()
                if k.startswith(f"model.layers.{N}.")
            }
            | {"embed_tokens.weight": self.state["model.embed_tokens.weight"], "norm.weight": torch.ones(64)},
        )
        self.block.norm = nn.Identity()
        g = torch.Generator().manual_seed(seed + 1)
        self.own = {
            "enorm.weight": 1 + 0.2 * torch.randn(64, generator=g),
            "hnorm.weight": 1 + 0.2 * torch.randn(64, generator=g),
            "eh_proj.weight": 0.15 * torch.randn(64, 128, generator=g),
            "shared_head.norm.weight": 1 + 0.2 * torch.randn(64, generator=g),
        }
        if echo:
            self.own = {
                "enorm.weight": torch.ones(64),
                "hnorm.weight": torch.ones(64),
                "eh_proj.weight": torch.cat((torch.zeros(64, 64), torch.eye(64)), dim=1),
                "shared_head.norm.weight": torch.ones(64),
            }

    def save(self, path: Path, with_mtp: bool = True) -> Path:
        from safetensors.torch import save_file

        path.mkdir(parents=True, exist_ok=True)
        tensors = {k: v for k, v in self.state.items() if with_mtp or not k.startswith(f"model.layers.{N}.")}
        if with_mtp:
            tensors |= {f"model.layers.{N}.{k}": v for k, v in self.own.items()}
            tensors[f"model.layers.{N}.embed_tokens.weight"] = self.state["model.embed_tokens.weight"].clone()
            tensors[f"model.layers.{N}.shared_head.head.weight"] = self.state["lm_head.weight"].clone()
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
        config = self.target.config.to_dict()
        config["num_nextn_predict_layers"] = 1 if with_mtp else 0
        (path / "config.json").write_text(json.dumps(config))
        save_word_tokenizer(path, 384)
        return path

    @torch.no_grad()
    def reference(self, tokens: list[int], embeds: Tensor, features: Tensor) -> tuple[Tensor, Tensor]:
        """(logits, fed-back states) of MTP rows at positions 0..: ``h = eh_proj([rms(emb), rms(feature)])``,
        the block, then the shared norm and the target's head."""

        def rms(x: Tensor, w: Tensor) -> Tensor:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w

        embeds = embeds.clone()
        embeds[0] = 0  # position 0 has no previous token
        x = torch.cat((rms(embeds, self.own["enorm.weight"]), rms(features, self.own["hnorm.weight"])), -1)
        x = x @ self.own["eh_proj.weight"].T
        out = self.block(inputs_embeds=x[None]).last_hidden_state[0]
        return self.target.lm_head(rms(out, self.own["shared_head.norm.weight"])), out

    @torch.no_grad()
    def final_states(self, tokens: list[int]) -> Tensor:
        return self.target.model(torch.tensor([tokens])).last_hidden_state[0]


@pytest.fixture(scope="module")
def mtp() -> Mtp:
    return Mtp()


@pytest.fixture(scope="module")
def checkpoint(mtp: Mtp, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return mtp.save(tmp_path_factory.mktemp("mtp"))


def test_the_layer_matches_the_reference(mtp: Mtp, checkpoint: Path) -> None:
    from sonar.kernels.attention import AttentionMetadata, allocate_kv_caches
    from sonar.models.loader import load_model

    loaded = load_model(str(checkpoint), dtype="float32")
    head = load_mtp_head(checkpoint, loaded.model, torch.float32, torch.device("cpu"))
    tokens = [5, 17, 3, 88, 41, 9, 60, 2, 33, 71]
    next_ids = tokens[1:] + [12]
    n = len(tokens)
    meta = AttentionMetadata.build([n], [n], [[0]], 16)
    caches = allocate_kv_caches(N, 2, 16, 1, loaded.model.head_dim, torch.float32, "cpu")
    with torch.no_grad():
        hidden = loaded.model(torch.tensor(tokens), torch.arange(n), caches, meta)
        torch.testing.assert_close(hidden, mtp.final_states(tokens), atol=1e-4, rtol=1e-4)
        head_caches = allocate_kv_caches(1, 2, 16, 1, head.head_dim, torch.float32, "cpu")
        states, fed = head(torch.tensor(next_ids), torch.arange(n), hidden, head_caches, meta)
        want, want_fed = mtp.reference(tokens, mtp.target.model.embed_tokens(torch.tensor(next_ids)), hidden)
    torch.testing.assert_close(head.compute_logits(states), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fed, want_fed, atol=1e-4, rtol=1e-4)


def test_missing_or_foreign_mtp_layers_are_refused(mtp: Mtp, tmp_path: Path) -> None:
    from sonar.models.loader import load_model

    plain = mtp.save(tmp_path / "plain", with_mtp=False)
    loaded = load_model(str(plain), dtype="float32")
    with pytest.raises(ModelLoadError, match="no num_nextn_predict_layers"):
        load_mtp_head(plain, loaded.model, torch.float32, torch.device("cpu"))
    config = json.loads((plain / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (plain / "config.json").write_text(json.dumps(config))
    loaded = load_model(str(plain), dtype="float32")
    with pytest.raises(ModelLoadError, match="lacks MTP weights"):
        load_mtp_head(plain, loaded.model, torch.float32, torch.device("cpu"))


def test_the_runner_drafts_what_the_reference_predicts(mtp: Mtp, checkpoint: Path) -> None:
    """One prefill step: the target's token, then K drafts chained through the one MTP layer."""
    config = EngineConfig.from_args(
        str(checkpoint),
        dtype="float32",
        num_gpu_blocks_override=16,
        speculative_config={"method": "mtp", "num_speculative_tokens": K},
    )
    runner = ModelRunner(config)
    prompt = [5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 14]
    params = SamplingParams(temperature=0, max_tokens=16)
    sched = ScheduledRequest("r", prompt, 0, [0], True, True, len(prompt))
    step = ExecuteStep(SchedulerOutput(0, [sched], len(prompt), [], []), [NewRequestData("r", params, prompt, [])])
    result = runner.execute(step)
    [token] = result.sampled["r"]
    embed = mtp.target.model.embed_tokens
    with torch.no_grad():
        assert token == int(mtp.target(torch.tensor([prompt])).logits[0, -1].argmax())
        features = mtp.final_states(prompt)
        embeds = embed(torch.tensor(prompt[1:] + [token]))
        drafts = []
        for _ in range(K):
            logits, fed = mtp.reference(prompt, embeds, features)
            drafts.append(int(logits[-1].argmax()))
            embeds = torch.cat((embeds, embed(torch.tensor(drafts[-1:]))))
            features = torch.cat((features, fed[-1:]))
    assert result.proposed["r"] == drafts

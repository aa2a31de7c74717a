"""What each GGUF architecture Sonar converts means in Hugging Face terms: the transformers config
class and architecture name, the per-layer tensor names, and the quirks llama.cpp's converter put
into the file that the conversion undoes.

The quirks, from llama.cpp's ``convert_hf_to_gguf.py``:

* ``llama`` and ``granite`` reorder the q/k rows so each head's rotary pairs are adjacent
  (`permute_qk`); the other families keep the checkpoint's order;
* Gemma's norms scale by ``1 + weight``; the converter stores ``weight + 1`` (`norm_offset`);
* Phi-3 and GLM-4 keep gate and up fused in ``ffn_up`` (Phi-3 also q/k/v in ``attn_qkv``);
* experts are stacked ``[n_expert, ...]`` (``ffn_gate_exps``, ``ffn_up_exps``, ``ffn_down_exps``),
  which the conversion turns into transformers' stacked ``mlp.experts.gate_up_proj`` /
  ``down_proj``; Mixtral is architecture ``llama`` with an ``expert_count``;
* settings the file does not store are implied by the architecture as llama.cpp implies them
  (Gemma 2/3's query scale, Gemma 3's sliding-window pattern and local rope base, Qwen-MoE's
  top-k renormalization);
* ``deepseek2`` (DeepSeek-V2 and V3; V3 told apart by its sigmoid ``expert_gating_func``) stores
  multi-head latent attention as llama.cpp runs it: newer converters write ``kv_b_proj`` split per
  head into ``attn_k_b`` (``[H, kv_lora_rank, qk_nope]``, transposed) and ``attn_v_b``
  (``[H, v_head, kv_lora_rank]``) and the head sizes as ``key_length_mla`` / ``value_length_mla``
  (``key_length`` is then the latent's), older ones ``attn_kv_b`` and the heads' sizes; yarn's
  ``mscale_all_dim`` is stored as ``yarn_log_multiplier`` (times 0.1), the V3 router's
  ``e_score_correction_bias`` as ``exp_probs_b.bias``;
* ``gpt-oss`` splits transformers' interleaved ``gate_up_proj`` (and its bias) into stacked
  ``ffn_gate_exps`` / ``ffn_up_exps`` with ``.bias`` tensors beside them, stores the router as
  ``ffn_gate_inp`` (with a bias) and the sinks as ``attn_sinks``; llama.cpp implies the
  alternating sliding window (even layers slide), the rest of YaRN (``beta_fast`` 32,
  ``beta_slow`` 1, no truncation) and the clamped SwiGLU (limit 7, alpha 1.702: transformers'
  defaults). Its experts are MXFP4 in the published files, served quantized like other families'.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from sonar.models.errors import ModelLoadError

Meta = Callable[..., Any]
"""``meta(key, default=None)``: the value of ``{arch}.{key}`` in the file's metadata."""

_ATTENTION = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_PRE_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_EXPERTS = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_SHARED_EXPERT = {
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_SANDWICH_NORMS = {  # Gemma 2/3: a norm before and after each of attention and MLP
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

EXPERT_PARTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
"""Stacked ``[n_expert, ...]`` tensors: their Hugging Face names carry no ``.weight``."""
PARAMETER_PARTS = ("exp_probs_b", "attn_sinks")
"""Tensors whose Hugging Face name is a whole parameter's (no ``.weight`` / ``.bias`` added)."""


@dataclass(frozen=True)
class GGUFArch:
    config_class: str
    architecture: str
    tensors: Mapping[str, str]
    """GGUF per-layer tensor (``attn_q``) -> Hugging Face module (``self_attn.q_proj``)."""
    config: Callable[[Meta, set[str]], dict[str, Any]] = field(default=lambda meta, names: {})
    """Family-specific config fields from the metadata and the file's tensor names."""
    permute_qk: bool = False
    norm_offset: float = 0.0
    plain: frozenset[str] = frozenset()
    """GGUF tensors always read dequantized: the model keeps them as tensors, not linear layers
    (DeepSeek's router and latent expansion ``kv_b_proj``)."""
    keep_none: frozenset[str] = frozenset()
    """Config fields whose None from `config` is meant (not "the config class's default")."""
    interleaved_experts: bool = False
    """Whether the experts convert to GPT-OSS's layout: ``gate_up_proj`` ``[E, h, 2 I]`` with gate
    and up in alternating columns, ``down_proj`` ``[E, I, h]``, and their biases."""


def _gemma_query_scalar(meta: Meta, head_dim: int, layers_of_27b: int) -> int:
    """llama.cpp scales Gemma 2/3 queries by ``1/sqrt(head_dim)``, except the 27B models (told
    apart by their layer count), which use ``hidden / heads``; the file stores neither."""
    scale = meta("attention.scale")
    if scale:
        return round(1.0 / float(scale) ** 2)
    if int(meta("block_count")) == layers_of_27b:
        return int(meta("embedding_length")) // int(meta("attention.head_count"))
    return head_dim


def _head_dim(meta: Meta) -> int:
    return int(meta("attention.key_length") or int(meta("embedding_length")) // int(meta("attention.head_count")))


def _gemma2(meta: Meta, names: set[str]) -> dict[str, Any]:
    return {
        "sliding_window": meta("attention.sliding_window"),
        "attn_logit_softcapping": meta("attn_logit_softcapping"),
        "final_logit_softcapping": meta("final_logit_softcapping"),
        "query_pre_attn_scalar": _gemma_query_scalar(meta, _head_dim(meta), layers_of_27b=46),
    }


def _sliding_layers(meta: Meta, layers: int, default_pattern: int) -> list[bool]:
    """Which layers attend over the sliding window: the file's pattern (a period, the last layer
    of each period global, or one flag per layer), else the architecture's period."""
    pattern = meta("attention.sliding_window_pattern", default_pattern)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ModelLoadError(f"sliding_window_pattern lists {len(pattern)} layers for {layers}")
        return [bool(p) for p in pattern]
    period = int(pattern)
    return [period == 0 or i % period < period - 1 for i in range(layers)]


def _gemma3(meta: Meta, names: set[str]) -> dict[str, Any]:
    layers = int(meta("block_count"))
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": float(meta("rope.freq_base", 1_000_000.0))}
    scaling = meta("rope.scaling.type")
    if scaling == "linear":
        full.update(rope_type="linear", factor=float(meta("rope.scaling.factor")))
    elif scaling not in (None, "none"):
        raise ModelLoadError(f"Gemma 3 rope scaling {scaling!r} is not supported")
    sliding = _sliding_layers(meta, layers, default_pattern=6)
    return {
        "sliding_window": meta("attention.sliding_window"),
        "attn_logit_softcapping": meta("attn_logit_softcapping"),
        "final_logit_softcapping": meta("final_logit_softcapping"),
        "query_pre_attn_scalar": _gemma_query_scalar(meta, _head_dim(meta), layers_of_27b=62),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "rope_parameters": {
            # llama.cpp's local rope base for Gemma 3 unless the file names one
            "sliding_attention": {"rope_type": "default", "rope_theta": float(meta("rope.freq_base_swa", 10000.0))},
            "full_attention": full,
        },
    }


def _partial_rotary(meta: Meta, head_dim: int) -> dict[str, Any]:
    rotary = meta("rope.dimension_count")
    return {} if rotary is None or int(rotary) == head_dim else {"partial_rotary_factor": int(rotary) / head_dim}


def _phi3(meta: Meta, names: set[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"sliding_window": meta("attention.sliding_window")}
    out.update(_partial_rotary(meta, _head_dim(meta)))
    original = meta("rope.scaling.original_context_length")
    if original is not None:
        out["original_max_position_embeddings"] = int(original)
    return out


def _glm4(meta: Meta, names: set[str]) -> dict[str, Any]:
    if meta("rope.dimension_sections") is not None:  # GLM-4V: M-RoPE, q/k rows permuted for it
        raise ModelLoadError("a glm4 GGUF with M-RoPE sections (GLM-4V) is not converted; Sonar serves GLM-4 text")
    return _partial_rotary(meta, _head_dim(meta))


def _granite(meta: Meta, names: set[str]) -> dict[str, Any]:
    return {
        "embedding_multiplier": meta("embedding_scale"),
        "residual_multiplier": meta("residual_scale"),
        "attention_multiplier": meta("attention.scale"),
        "logits_scaling": meta("logit_scale"),
        "mlp_bias": "blk.0.ffn_up.bias" in names,
    }


def _dense_layers(meta: Meta, names: set[str]) -> list[int]:
    """The layers without a router: dense MLPs between the sparse ones."""
    return [i for i in range(int(meta("block_count"))) if f"blk.{i}.ffn_gate_inp.weight" not in names]


def _qwen_moe(renormalize: bool) -> Callable[[Meta, set[str]], dict[str, Any]]:
    def config(meta: Meta, names: set[str]) -> dict[str, Any]:
        out = {
            "num_experts": int(meta("expert_count")),
            "num_experts_per_tok": int(meta("expert_used_count")),
            "moe_intermediate_size": int(meta("expert_feed_forward_length")),
            "norm_topk_prob": bool(meta("expert_weights_norm", renormalize)),
            "decoder_sparse_step": 1,
            "mlp_only_layers": _dense_layers(meta, names),
        }
        shared = meta("expert_shared_feed_forward_length")
        if shared is not None:
            out["shared_expert_intermediate_size"] = int(shared)
        return out

    return config


def _mixtral(meta: Meta, names: set[str]) -> dict[str, Any]:
    if _dense_layers(meta, names):
        raise ModelLoadError(f"layers {_dense_layers(meta, names)} of a Mixtral GGUF have no router")
    return {
        "num_local_experts": int(meta("expert_count")),
        "num_experts_per_tok": int(meta("expert_used_count")),
        "intermediate_size": int(meta("expert_feed_forward_length") or meta("feed_forward_length")),
        "sliding_window": meta("attention.sliding_window"),
    }


_GATING_SIGMOID = 2
"""llama.cpp's ``expert_gating_func``: 1 softmax (DeepSeek-V2), 2 sigmoid (V3)."""


def _deepseek2(meta: Meta, names: set[str]) -> dict[str, Any]:
    heads, rope = int(meta("attention.head_count")), int(meta("rope.dimension_count"))
    mla = meta("attention.key_length_mla") is not None  # newer converters: key_length is the latent's
    qk = int(meta("attention.key_length_mla" if mla else "attention.key_length"))
    v_head = int(meta("attention.value_length_mla" if mla else "attention.value_length"))
    groups, top_groups = int(meta("expert_group_count", 1) or 1), int(meta("expert_group_used_count", 1) or 1)
    sigmoid = int(meta("expert_gating_func", 1)) == _GATING_SIGMOID
    q_lora = meta("attention.q_lora_rank")
    out: dict[str, Any] = {
        "num_key_value_heads": heads,
        "head_dim": rope,
        "q_lora_rank": int(q_lora) if q_lora else None,
        "kv_lora_rank": int(meta("attention.kv_lora_rank")),
        "qk_nope_head_dim": qk - rope,
        "qk_rope_head_dim": rope,
        "v_head_dim": v_head,
        "n_routed_experts": int(meta("expert_count")),
        "num_experts_per_tok": int(meta("expert_used_count")),
        "n_shared_experts": int(meta("expert_shared_count", 0)),
        "moe_intermediate_size": int(meta("expert_feed_forward_length")),
        "first_k_dense_replace": int(meta("leading_dense_block_count", 0)),
        "routed_scaling_factor": float(meta("expert_weights_scale", 1.0)),
        "n_group": groups,
        "topk_group": top_groups,
    }
    if sigmoid:  # V3: llama.cpp rotates adjacent pairs, transformers' V3 does with rope_interleave
        out.update(
            topk_method="noaux_tc", norm_topk_prob=bool(meta("expert_weights_norm", False)), rope_interleave=True
        )
        if "blk.{}.exp_probs_b.bias".format(out["first_k_dense_replace"]) not in names:
            raise ModelLoadError("a deepseek2 GGUF with sigmoid gating lacks its exp_probs_b (noaux_tc) biases")
    else:
        out["topk_method"] = "group_limited_greedy" if groups > 1 else "greedy"
        if meta("expert_weights_norm", False):
            raise ModelLoadError(
                "a DeepSeek-V2 GGUF with expert_weights_norm true is not served (V2 does not renormalize)"
            )
    if meta("rope.scaling.type") == "yarn":
        # llama.cpp keeps 0.1 * mscale_all_dim; the published configs have mscale == mscale_all_dim
        m_all = float(meta("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
        out["rope_parameters"] = {
            "rope_type": "yarn",
            "rope_theta": float(meta("rope.freq_base", 10000.0)),
            "factor": float(meta("rope.scaling.factor")),
            "original_max_position_embeddings": int(meta("rope.scaling.original_context_length")),
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": m_all,
            "mscale_all_dim": m_all,
        }
    return out


_GPT_OSS_SWIGLU = {"swiglu_limit": 7.0, "swiglu_alpha": 1.702}
"""What llama.cpp's GPT-OSS graph hardcodes (the published configs' values)."""


def _gpt_oss(meta: Meta, names: set[str]) -> dict[str, Any]:
    layers = int(meta("block_count"))
    out: dict[str, Any] = {
        "num_local_experts": int(meta("expert_count")),
        "num_experts_per_tok": int(meta("expert_used_count")),
        "intermediate_size": int(meta("expert_feed_forward_length") or meta("feed_forward_length")),
        "sliding_window": int(meta("attention.sliding_window")),
        # llama.cpp's swa pattern 2: the even layers slide, as transformers' default layer_types
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        **_GPT_OSS_SWIGLU,
    }
    if _dense_layers(meta, names):
        raise ModelLoadError(f"layers {_dense_layers(meta, names)} of a gpt-oss GGUF have no router")
    scaling = meta("rope.scaling.type")
    if scaling == "yarn":
        out["rope_parameters"] = {
            "rope_type": "yarn",
            "rope_theta": float(meta("rope.freq_base", 10000.0)),
            "factor": float(meta("rope.scaling.factor")),
            "original_max_position_embeddings": int(meta("rope.scaling.original_context_length")),
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        }
    elif scaling not in (None, "none"):
        raise ModelLoadError(f"gpt-oss rope scaling {scaling!r} is not supported (only yarn)")
    return out


_LLAMA_TENSORS = {**_PRE_NORMS, **_ATTENTION, **_MLP}

ARCHITECTURES: dict[str, GGUFArch] = {
    "llama": GGUFArch("LlamaConfig", "LlamaForCausalLM", _LLAMA_TENSORS, permute_qk=True),
    "qwen2": GGUFArch("Qwen2Config", "Qwen2ForCausalLM", _LLAMA_TENSORS),
    "qwen3": GGUFArch("Qwen3Config", "Qwen3ForCausalLM", _LLAMA_TENSORS),
    "gemma": GGUFArch("GemmaConfig", "GemmaForCausalLM", _LLAMA_TENSORS, norm_offset=1.0),
    "gemma2": GGUFArch(
        "Gemma2Config", "Gemma2ForCausalLM", {**_SANDWICH_NORMS, **_ATTENTION, **_MLP}, _gemma2, norm_offset=1.0
    ),
    "gemma3": GGUFArch(
        "Gemma3TextConfig", "Gemma3ForCausalLM", {**_SANDWICH_NORMS, **_ATTENTION, **_MLP}, _gemma3, norm_offset=1.0
    ),
    "phi3": GGUFArch(
        "Phi3Config",
        "Phi3ForCausalLM",
        {**_LLAMA_TENSORS, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
        _phi3,
    ),
    "granite": GGUFArch("GraniteConfig", "GraniteForCausalLM", _LLAMA_TENSORS, _granite, permute_qk=True),
    "olmo2": GGUFArch(
        "Olmo2Config",
        "Olmo2ForCausalLM",
        {
            **_ATTENTION,
            **_MLP,
            "post_attention_norm": "post_attention_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
        },
    ),
    "glm4": GGUFArch(
        "Glm4Config",
        "Glm4ForCausalLM",
        {
            **_LLAMA_TENSORS,
            "ffn_up": "mlp.gate_up_proj",
            "post_attention_norm": "post_self_attn_layernorm",
            "post_ffw_norm": "post_mlp_layernorm",
        },
        _glm4,
    ),
    "qwen2moe": GGUFArch(
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {**_LLAMA_TENSORS, **_EXPERTS, **_SHARED_EXPERT},
        _qwen_moe(renormalize=False),
    ),
    "qwen3moe": GGUFArch(
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM", {**_LLAMA_TENSORS, **_EXPERTS}, _qwen_moe(renormalize=True)
    ),
    "gpt-oss": GGUFArch(
        "GptOssConfig",
        "GptOssForCausalLM",
        {
            **_ATTENTION,
            **_EXPERTS,
            "attn_norm": "input_layernorm",
            "post_attention_norm": "post_attention_layernorm",
            "attn_sinks": "self_attn.sinks",
            "ffn_gate_inp": "mlp.router",
        },
        _gpt_oss,
        interleaved_experts=True,
    ),
}

DEEPSEEK_V2 = GGUFArch(
    "DeepseekV2Config",
    "DeepseekV2ForCausalLM",
    {
        **_PRE_NORMS,
        **_MLP,
        **_EXPERTS,
        "attn_q": "self_attn.q_proj",
        "attn_q_a": "self_attn.q_a_proj",
        "attn_q_a_norm": "self_attn.q_a_layernorm",
        "attn_q_b": "self_attn.q_b_proj",
        "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
        "attn_kv_a_norm": "self_attn.kv_a_layernorm",
        "attn_kv_b": "self_attn.kv_b_proj",
        "attn_k_b": "self_attn.k_b_proj",  # joined with v_b into kv_b_proj (`gguf_file`)
        "attn_v_b": "self_attn.v_b_proj",
        "attn_output": "self_attn.o_proj",
        "exp_probs_b": "mlp.gate.e_score_correction_bias",
        "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
        "ffn_up_shexp": "mlp.shared_expert.up_proj",
        "ffn_down_shexp": "mlp.shared_expert.down_proj",
    },
    _deepseek2,
    plain=frozenset({"ffn_gate_inp", "attn_kv_b", "attn_k_b", "attn_v_b"}),
    keep_none=frozenset({"q_lora_rank"}),
)
DEEPSEEK_V3 = replace(DEEPSEEK_V2, config_class="DeepseekV3Config", architecture="DeepseekV3ForCausalLM")
"""A ``deepseek2`` file with sigmoid gating (`_GATING_SIGMOID`)."""


def deepseek2(gating: Any) -> GGUFArch:
    """The mapping of a ``deepseek2`` file by its ``expert_gating_func``."""
    return DEEPSEEK_V3 if gating is not None and int(gating) == _GATING_SIGMOID else DEEPSEEK_V2


MIXTRAL = GGUFArch("MixtralConfig", "MixtralForCausalLM", {**_LLAMA_TENSORS, **_EXPERTS}, _mixtral, permute_qk=True)
"""A ``llama`` file with an ``expert_count``."""

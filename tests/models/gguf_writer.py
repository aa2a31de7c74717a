"""A transformers model written to a GGUF file as llama.cpp's ``convert_hf_to_gguf.py`` writes it
(written here from llama.cpp's rules, independently of Sonar's reading tables): its tensor
names, the q/k row permutation of the ``llama`` and ``granite`` converters, Gemma's norms stored
as ``1 + weight``, fused and stacked tensors, the metadata keys, and optionally blocks of a quant
type (2-D and stacked tensors whose rows split into whole blocks, as llama.cpp quantizes)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

#: HF module -> GGUF tensor, as llama.cpp's tensor_mapping names them for the llama-like families
LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.experts.down_proj": "ffn_down_exps",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
SANDWICH = {  # Gemma 2/3's four norms per layer
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}


def _gemma2(w: Any, c: Any) -> None:
    assert c.query_pre_attn_scalar == c.head_dim, "llama.cpp implies the query scale from head_dim"
    w.add_sliding_window(c.sliding_window)
    w.add_attn_logit_softcapping(c.attn_logit_softcapping)
    w.add_final_logit_softcapping(c.final_logit_softcapping)


def _gemma3(w: Any, c: Any) -> None:
    assert c.query_pre_attn_scalar == c.head_dim, "llama.cpp implies the query scale from head_dim"
    assert c.layer_types == [
        "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(len(c.layer_types))
    ]
    from gguf import RopeScalingType

    w.add_sliding_window(c.sliding_window)
    full = c.rope_parameters["full_attention"]
    assert c.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0, "llama.cpp's implied local base"
    w.add_rope_freq_base(full["rope_theta"])
    if full["rope_type"] == "linear":
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    if c.final_logit_softcapping is not None:
        w.add_final_logit_softcapping(c.final_logit_softcapping)


def _rotary_dims(c: Any) -> int:
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return int(head_dim * c.rope_parameters.get("partial_rotary_factor", 1.0))


def _phi3(w: Any, c: Any) -> None:
    rope = c.rope_parameters
    w.add_rope_dimension_count(_rotary_dims(c))
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    scale = c.max_position_embeddings / rope["original_max_position_embeddings"]
    w.add_rope_scaling_attn_factors(
        1.0 if scale <= 1 else float(np.sqrt(1 + np.log(scale) / np.log(rope["original_max_position_embeddings"])))
    )
    w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
    w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32))


def _granite(w: Any, c: Any) -> None:
    w.add_embedding_scale(c.embedding_multiplier)
    w.add_residual_scale(c.residual_multiplier)
    w.add_attention_scale(c.attention_multiplier)
    w.add_logit_scale(c.logits_scaling)


def _linear_rope(w: Any, c: Any) -> None:
    from gguf import RopeScalingType

    if c.rope_parameters["rope_type"] == "linear":
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(c.rope_parameters["factor"])


def _experts(w: Any, c: Any) -> None:
    w.add_expert_count(getattr(c, "num_local_experts", None) or c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    if hasattr(c, "moe_intermediate_size"):
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    if getattr(c, "shared_expert_intermediate_size", None):
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)


DEEPSEEK = {
    "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}


def _deepseek2(split_kv_b: bool) -> Callable[[Any, Any], None]:
    """llama.cpp's ``DeepseekV2Model.set_gguf_parameters``: the MLA sizes as the newer converters
    (`split_kv_b`: ``kv_b_proj`` written as ``attn_k_b`` / ``attn_v_b``) or the older ones write them."""

    def metadata(w: Any, c: Any) -> None:
        from gguf import ExpertGatingFuncType, RopeScalingType

        w.add_leading_dense_block_count(c.first_k_dense_replace)
        if c.q_lora_rank:
            w.add_q_lora_rank(c.q_lora_rank)
        w.add_kv_lora_rank(c.kv_lora_rank)
        if split_kv_b:
            w.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
            w.add_value_length(c.kv_lora_rank)
            w.add_key_length_mla(c.qk_nope_head_dim + c.qk_rope_head_dim)
            w.add_value_length_mla(c.v_head_dim)
        else:
            w.add_key_length(c.qk_nope_head_dim + c.qk_rope_head_dim)
            w.add_value_length(c.v_head_dim)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_count(c.n_routed_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_shared_count(c.n_shared_experts)
        w.add_expert_weights_scale(c.routed_scaling_factor)
        w.add_expert_weights_norm(bool(c.norm_topk_prob))
        v3 = c.model_type == "deepseek_v3"
        w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID if v3 else ExpertGatingFuncType.SOFTMAX)
        if (c.n_group or 1) > 1:
            w.add_expert_group_count(c.n_group)
            w.add_expert_group_used_count(c.topk_group)
        w.add_rope_dimension_count(c.qk_rope_head_dim)
        rope = c.rope_parameters
        if rope["rope_type"] == "yarn":
            assert rope["mscale"] == rope["mscale_all_dim"], "llama.cpp stores mscale_all_dim only"
            w.add_rope_scaling_type(RopeScalingType.YARN)
            w.add_rope_scaling_factor(rope["factor"])
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])

    return metadata


def _gpt_oss(w: Any, c: Any) -> None:
    """llama.cpp's ``GptOssModel.set_gguf_parameters``: the experts, the window, YaRN's factor and
    original context (the rest of YaRN, the layer pattern and the SwiGLU clamp are implied)."""
    from gguf import RopeScalingType

    rope = c.rope_parameters
    assert (rope["beta_fast"], rope["beta_slow"], rope.get("truncate")) == (32.0, 1.0, False), "llama.cpp implies them"
    assert c.layer_types == ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(len(c.layer_types))]
    assert (c.swiglu_limit, c.swiglu_alpha) == (7.0, 1.702), "llama.cpp hardcodes them"
    _experts(w, c)
    w.add_sliding_window(c.sliding_window)
    w.add_expert_feed_forward_length(c.intermediate_size)
    w.add_rope_scaling_type(RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])


GPT_OSS = {
    "post_attention_layernorm": "post_attention_norm",
    "mlp.router": "ffn_gate_inp",
}


def _gpt_oss_experts(layer: str, rest: str, array: np.ndarray) -> dict[str, np.ndarray] | None:
    """llama.cpp's split of GPT-OSS's experts: transformers' ``gate_up_proj`` ``[E, h, 2 I]``
    (gate and up in alternating columns) transposed and de-interleaved into stacked gate / up
    ``[E, I, h]``, ``down_proj`` ``[E, I, h]`` transposed, the biases split the same way."""
    if rest == "mlp.experts.gate_up_proj":
        rows = array.swapaxes(1, 2)
        return {f"blk.{layer}.ffn_gate_exps.weight": rows[:, 0::2], f"blk.{layer}.ffn_up_exps.weight": rows[:, 1::2]}
    if rest == "mlp.experts.gate_up_proj_bias":
        return {f"blk.{layer}.ffn_gate_exps.bias": array[:, 0::2], f"blk.{layer}.ffn_up_exps.bias": array[:, 1::2]}
    if rest == "mlp.experts.down_proj":
        return {f"blk.{layer}.ffn_down_exps.weight": array.swapaxes(1, 2)}
    if rest == "mlp.experts.down_proj_bias":
        return {f"blk.{layer}.ffn_down_exps.bias": array}
    if rest == "self_attn.sinks":
        return {f"blk.{layer}.attn_sinks.weight": array}
    return None


def _gpt_oss_read_back(config: Any, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """The inverse of `_gpt_oss_experts` on the experts as the file holds them."""
    out = {}
    for layer in range(config.num_hidden_layers):
        gate, up = arrays[f"blk.{layer}.ffn_gate_exps.weight"], arrays[f"blk.{layer}.ffn_up_exps.weight"]
        joined = np.stack([gate, up], axis=2).reshape(gate.shape[0], -1, gate.shape[2]).swapaxes(1, 2)
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.from_numpy(np.ascontiguousarray(joined))
        down = arrays[f"blk.{layer}.ffn_down_exps.weight"].swapaxes(1, 2)
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.from_numpy(np.ascontiguousarray(down))
    return out


@dataclass(frozen=True)
class Family:
    arch: str
    names: dict[str, str] = field(default_factory=dict)
    """Overrides of `LAYER` for this family."""
    metadata: Callable[[Any, Any], None] = lambda w, c: None
    permute_qk: bool = False
    norm_plus_one: bool = False
    split_kv_b: bool = False
    """DeepSeek's ``kv_b_proj`` per head into ``attn_k_b`` (transposed) and ``attn_v_b``; the
    writer keeps both float (their blocks would not follow the Hugging Face tensor's rows)."""
    head_dim_keys: bool = True
    """Whether ``head_dim`` is written as the key/value lengths (DeepSeek writes its own)."""


FAMILIES = {
    "gemma": Family("gemma", norm_plus_one=True),
    "gemma2": Family("gemma2", SANDWICH, _gemma2, norm_plus_one=True),
    "gemma3": Family("gemma3", SANDWICH, _gemma3, norm_plus_one=True),
    "phi3": Family("phi3", {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}, _phi3),
    "granite": Family("granite", {}, _granite, permute_qk=True),
    "olmo2": Family(
        "olmo2",
        {"post_attention_layernorm": "post_attention_norm", "post_feedforward_layernorm": "post_ffw_norm"},
        _linear_rope,
    ),  # fmt: skip
    "glm4": Family(
        "glm4",
        {
            "mlp.gate_up_proj": "ffn_up",
            "post_self_attn_layernorm": "post_attention_norm",
            "post_mlp_layernorm": "post_ffw_norm",
        },
        lambda w, c: w.add_rope_dimension_count(_rotary_dims(c)),
    ),  # fmt: skip
    "mixtral": Family("llama", {}, _experts, permute_qk=True),
    "qwen2_moe": Family("qwen2moe", {}, _experts),
    "qwen3_moe": Family("qwen3moe", {}, _experts),
    "deepseek_v2": Family("deepseek2", DEEPSEEK, _deepseek2(False), head_dim_keys=False),
    "deepseek_v3": Family("deepseek2", DEEPSEEK, _deepseek2(True), split_kv_b=True, head_dim_keys=False),
    "gpt_oss": Family("gpt-oss", GPT_OSS, _gpt_oss),
}
NOT_QUANTIZED = ("ffn_gate_inp", "attn_k_b", "attn_v_b")
"""Kept float: llama.cpp never quantizes a router; the split ``kv_b`` (`Family.split_kv_b`)."""


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: each head's rotary halves interleaved into adjacent pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def quantizable(array: np.ndarray, qtype: Any, tensor_name: str = "") -> bool:
    """Whether llama.cpp would write this tensor in `qtype`: matrices whose rows split into whole
    blocks, never a bias, and MXFP4 only for stacked experts (llama.cpp's MXFP4 files)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if qtype is None or array.ndim < 2 or array.shape[-1] % GGML_QUANT_SIZES[qtype][0] or tensor_name.endswith(".bias"):
        return False
    return qtype != GGMLQuantizationType.MXFP4 or "_exps." in tensor_name


def quant_round_trip(tensor: torch.Tensor, qtype: Any) -> torch.Tensor:
    """What a quantized tensor reads back as from the file: its blocks dequantized."""
    from gguf import dequantize, quantize

    array = tensor.detach().float().numpy()
    return torch.from_numpy(dequantize(quantize(array, qtype), qtype).reshape(array.shape).copy())


def _gguf_tensors(family: Family, config: Any, state: dict[str, torch.Tensor]) -> dict[str, tuple[str, np.ndarray]]:
    """GGUF name -> (the Hugging Face tensor it comes from, its array as the file holds it)."""
    names = {**LAYER, **family.names}
    out: dict[str, tuple[str, np.ndarray]] = {}
    for hf_name, tensor in state.items():
        array = tensor.detach().float().numpy()
        if hf_name == "lm_head.weight":
            if not config.tie_word_embeddings:
                out["output.weight"] = (hf_name, array)
            continue
        if hf_name in GLOBAL:
            name = GLOBAL[hf_name]
        else:
            _, _, layer, rest = hf_name.split(".", 3)
            split = _gpt_oss_experts(layer, rest, array) if family.arch == "gpt-oss" else None
            if split is not None:
                out.update({name: (hf_name, part) for name, part in split.items()})
                continue
            if rest == "mlp.experts.gate_up_proj":  # transformers' stacked [E, 2 I, h]: gate rows first
                gate, up = np.split(array, 2, axis=1)
                out[f"blk.{layer}.ffn_gate_exps.weight"] = (hf_name, gate)
                out[f"blk.{layer}.ffn_up_exps.weight"] = (hf_name, up)
                continue
            if rest == "mlp.gate.e_score_correction_bias":
                out[f"blk.{layer}.exp_probs_b.bias"] = (hf_name, array)
                continue
            if family.split_kv_b and rest == "self_attn.kv_b_proj.weight":  # llama.cpp's MLA layout
                c = config
                kv_b = array.reshape(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, -1)
                out[f"blk.{layer}.attn_k_b.weight"] = (hf_name, kv_b[:, : c.qk_nope_head_dim].transpose(0, 2, 1))
                out[f"blk.{layer}.attn_v_b.weight"] = (hf_name, kv_b[:, c.qk_nope_head_dim :])
                continue
            module, kind = (rest, "weight") if rest.startswith("mlp.experts.") else rest.rsplit(".", 1)
            name = f"blk.{layer}.{names[module]}.{kind}"
            if family.permute_qk and module == "self_attn.q_proj":
                array = llama_cpp_permute(array, config.num_attention_heads)
            elif family.permute_qk and module == "self_attn.k_proj":
                array = llama_cpp_permute(array, config.num_key_value_heads)
        if hf_name.endswith("shared_expert_gate.weight"):  # llama.cpp declares it {n_embd}
            array = array.reshape(-1)
        if family.norm_plus_one and hf_name.endswith("norm.weight"):
            array = array + 1
        out[name] = (hf_name, array)
    return out


def add_bpe_tokenizer(writer: Any, tokenizer: Any, vocab_size: int, chat_template: str | None = None) -> None:
    """A byte-level BPE `tokenizers.Tokenizer` as llama.cpp's ``_set_vocab_gpt2`` writes it: the
    tokens by id (ids the tokenizer lacks padded with unused ``[PAD{i}]``), special tokens as
    control tokens, the merges, and the chat template."""
    import json

    from gguf import TokenType

    spec = json.loads(tokenizer.to_str())
    by_id = {i: t for t, i in spec["model"]["vocab"].items()}
    special = {t["content"]: t["id"] for t in spec["added_tokens"]}
    by_id.update({i: t for t, i in special.items()})
    tokens, types = [], []
    for i in range(vocab_size):
        tokens.append(by_id.get(i, f"[PAD{i}]"))
        types.append(
            TokenType.CONTROL if i in special.values() else TokenType.NORMAL if i in by_id else TokenType.UNUSED
        )
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-4o")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]])
    writer.add_eos_token_id(min(special.values()))
    if chat_template is not None:
        writer.add_chat_template(chat_template)


def write_gguf(
    path: Path, name: str, hf: Any, qtype: Any = None, tokenizer: Callable[[Any], None] | None = None
) -> dict[str, torch.Tensor]:
    """Write `hf` (a transformers model of family `name` of `FAMILIES`) to `path`; returns its
    state dict as the file holds it (each quantized tensor's blocks dequantized; no tied head),
    for a transformers reference of the same weights. `tokenizer`: writes the tokenizer's
    metadata (`add_bpe_tokenizer`); without it the file carries none."""
    from gguf import GGUFWriter, dequantize, quantize

    family, config = FAMILIES[name], hf.config
    state = {k: v for k, v in hf.state_dict().items() if not k.endswith("rotary_emb.inv_freq")}
    writer = GGUFWriter(str(path), family.arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters
    if "rope_theta" in rope:  # Gemma 3 keeps one per layer type: its metadata writes the global one
        writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    if family.head_dim_keys and getattr(config, "head_dim", None):
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    family.metadata(writer, config)
    if tokenizer is not None:
        tokenizer(writer)
    quantized, read_back = set(), {}
    for tensor_name, (hf_name, array) in _gguf_tensors(family, config, state).items():
        array = np.ascontiguousarray(array)
        if quantizable(array, qtype, tensor_name) and not any(f".{part}." in tensor_name for part in NOT_QUANTIZED):
            quantized.add(hf_name)
            blocks = quantize(array, qtype)
            writer.add_tensor(tensor_name, blocks, raw_dtype=qtype)
            read_back[tensor_name] = dequantize(blocks, qtype).reshape(array.shape)
        else:
            writer.add_tensor(tensor_name, array)
            read_back[tensor_name] = array
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    # blocks run along rows, so splitting or permuting rows commutes with the round trip
    # (GPT-OSS's experts are transposed for the file: read back from its blocks)
    exact = _gpt_oss_read_back(config, read_back) if family.arch == "gpt-oss" else {}
    held = {
        k: exact[k] if k in exact else quant_round_trip(v, qtype) if k in quantized else v.detach().float().clone()
        for k, v in state.items()
    }
    if config.tie_word_embeddings:  # the file has no output matrix: the head is the embedding
        held.pop("lm_head.weight", None)
    return held

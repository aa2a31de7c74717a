"""GGUF files written here from the tiny transformers checkpoints, laid out as llama.cpp's converter
lays them out, read back through the loader: the same tensors and config come out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from sonar.models.errors import ModelLoadError, UnsupportedArchitectureError
from sonar.models.loader import load_model

GGUF_NAMES = {
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
}


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SONAR_CACHE_ROOT", str(tmp_path / "cache"))


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: each head's rotary halves interleaved into adjacent pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        _, _, layer, rest = hf_name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        return f"blk.{layer}.{GGUF_NAMES[module]}.{kind}"
    return {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }[hf_name]


def write_gguf(
    path: Path, arch: str, config: Any, tensors: dict[str, torch.Tensor], extra: dict[str, np.ndarray] | None = None
) -> None:
    writer = gguf_writer(path, arch, config)
    for name, tensor in tensors.items():
        array = tensor.detach().float().numpy()
        if arch == "llama" and ".q_proj." in name:
            array = llama_cpp_permute(array, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            array = llama_cpp_permute(array, config.num_key_value_heads)
        writer.add_tensor(gguf_name(name), np.ascontiguousarray(array))
    for name, array in (extra or {}).items():
        writer.add_tensor(name, array)
    close_gguf(writer)


def gguf_writer(path: Path, arch: str, config: Any) -> Any:
    """A `gguf.GGUFWriter` holding `config` as llama.cpp's converter writes it; add the tensors,
    then `close_gguf`."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    if getattr(config, "head_dim", None):
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    rope = config.rope_parameters
    if rope["rope_type"] == "yarn":
        from gguf import RopeScalingType

        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    return writer


def close_gguf(writer: Any) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def checkpoint_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


@pytest.mark.parametrize("name, arch", [("qwen2", "qwen2"), ("qwen3", "qwen3"), ("llama3", "llama")])
def test_round_trip(tiny_checkpoints: dict[str, Any], tmp_path: Path, name: str, arch: str) -> None:
    tiny = tiny_checkpoints[name]
    config = tiny.hf.config
    if name == "llama3":  # GGUF keeps Llama 3 scaling as a rope_freqs tensor, tested below
        config = type(config)(
            **{**config.to_dict(), "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
        )
    original = checkpoint_tensors(tiny.path)
    path = tmp_path / f"tiny-{name}.gguf"
    write_gguf(path, arch, config, original)
    loaded = load_model(str(path), dtype="float32")
    assert loaded.architecture == type(tiny.hf).__name__
    assert loaded.source == f"GGUF {path}"
    assert loaded.tokenizer_path is None  # these files carry no tokenizer
    ours = loaded.model
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "tie_word_embeddings",
    ):
        assert getattr(loaded.config, key) == getattr(config, key), key
    assert loaded.config.rope_parameters["rope_type"] == config.rope_parameters["rope_type"]
    assert ours.head_dim == (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    converted = checkpoint_tensors(loaded.model_dir)
    assert converted.keys() == original.keys()
    for key, tensor in original.items():
        assert torch.equal(converted[key], tensor), key
    again = load_model(str(path), dtype="float32")  # from the cache now
    assert again.model_dir == loaded.model_dir


def test_rope_freqs_is_refused(tiny_checkpoints: dict[str, Any], tmp_path: Path) -> None:
    tiny = tiny_checkpoints["llama3"]
    path = tmp_path / "llama3.gguf"
    write_gguf(
        path, "llama", tiny.hf.config, checkpoint_tensors(tiny.path), {"rope_freqs.weight": np.ones(8, np.float32)}
    )
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        load_model(str(path))


def test_unknown_gguf_architecture(tiny_checkpoints: dict[str, Any], tmp_path: Path) -> None:
    tiny = tiny_checkpoints["qwen2"]
    path = tmp_path / "other.gguf"
    write_gguf(path, "gpt2", tiny.hf.config, {})
    with pytest.raises(UnsupportedArchitectureError, match="unsupported GGUF architecture 'gpt2'"):
        load_model(str(path))


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"this is not a GGUF file at all" * 4)
    with pytest.raises(ModelLoadError, match="cannot read GGUF file"):
        load_model(str(path))

"""The packed-weight cache: a warm start takes the packed tensors from disk, and anything that
could make them wrong (another source file, other packing code, another layout or backend, a
damaged file) makes it pack again and rewrite the file."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from sonar.kernels.quant import QuantizedWeight, dequantize
from sonar.kernels.quant_linear import QuantLinear, ReferenceBackend, quant_meta
from sonar.models.decoder import DecoderForCausalLM
from sonar.models.pack_cache import PackCache, packing_code_hash
from sonar.models.quantized import install_quantized
from sonar.models.registry import model_class


def _weight(seed: int, n: int = 32, k: int = 64, group: int = 32) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, k // group, generator=g)
    offsets = torch.rand(n, k // group, generator=g)
    return QuantizedWeight("int4", values, scales, offsets, group)


def _source(tmp_path: Path) -> Path:
    source = tmp_path / "quantized.safetensors"
    source.write_bytes(b"quants")
    return source


def _fill(path: Path, source: Path, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    cache = PackCache(path, source)
    backend = ReferenceBackend()
    assert cache.get("layer", quant_meta(qw), backend) is None
    packed = backend.pack(qw)
    cache.put("layer", quant_meta(qw), backend, packed)
    cache.save()
    return packed


def test_a_saved_pack_is_read_back_as_it_was(tmp_path: Path) -> None:
    source, path, qw = _source(tmp_path), tmp_path / "packed.safetensors", _weight(0)
    packed = _fill(path, source, qw)
    assert path.is_file()
    warm = PackCache(path, source)
    hit = warm.get("layer", quant_meta(qw), ReferenceBackend())
    assert hit is not None and hit.keys() == packed.keys()
    for name, tensor in packed.items():
        assert torch.equal(hit[name], tensor)
    layer = QuantLinear(qw, None, ReferenceBackend(), packed=hit)
    torch.testing.assert_close(layer(torch.eye(64)).T, dequantize(qw, torch.float32))
    assert (warm.hits, warm.misses) == (1, 0)
    warm.save()  # all hits: nothing to write
    assert not list(tmp_path.glob(".packed*"))


def test_another_source_or_packing_code_misses(tmp_path: Path) -> None:
    source, path, qw = _source(tmp_path), tmp_path / "packed.safetensors", _weight(1)
    _fill(path, source, qw)
    meta, backend = quant_meta(qw), ReferenceBackend()
    assert PackCache(path, source, code="another packing").get("layer", meta, backend) is None
    stat = source.stat()
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # the quants were rebuilt
    assert PackCache(path, source).get("layer", meta, backend) is None
    assert len(packing_code_hash()) == 16


def test_another_layout_misses(tmp_path: Path) -> None:
    source, path = _source(tmp_path), tmp_path / "packed.safetensors"
    _fill(path, source, _weight(2, group=32))
    cache = PackCache(path, source)
    assert cache.get("layer", quant_meta(_weight(2, group=16)), ReferenceBackend()) is None
    assert cache.get("other", quant_meta(_weight(2, group=32)), ReferenceBackend()) is None
    assert cache.get("layer", quant_meta(_weight(2, group=32)), ReferenceBackend()) is not None


def test_a_damaged_file_is_packed_again_and_rewritten(tmp_path: Path) -> None:
    source, path, qw = _source(tmp_path), tmp_path / "packed.safetensors", _weight(3)
    _fill(path, source, qw)
    path.write_bytes(path.read_bytes()[:-40])  # truncated
    cache = PackCache(path, source)
    assert cache.get("layer", quant_meta(qw), ReferenceBackend()) is None
    cache.put("layer", quant_meta(qw), ReferenceBackend(), ReferenceBackend().pack(qw))
    cache.save()
    assert PackCache(path, source).get("layer", quant_meta(qw), ReferenceBackend()) is not None


def _tiny_decoder() -> DecoderForCausalLM:
    from transformers import LlamaConfig

    config = LlamaConfig(
        architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device("meta"):
        model = model_class(config)(config)
    return model.to_empty(device="cpu").to(torch.float32)


def test_install_takes_every_layer_from_a_warm_cache(tmp_path: Path) -> None:
    """The second install of the same quants packs nothing and builds the same layers."""
    parts = {"model.layers.0.self_attn.q_proj": (64, 64), "model.layers.0.self_attn.k_proj": (32, 64),
             "model.layers.0.self_attn.v_proj": (32, 64), "model.layers.0.self_attn.o_proj": (64, 64),
             "model.layers.0.mlp.gate_proj": (128, 64), "model.layers.0.mlp.up_proj": (128, 64),
             "model.layers.0.mlp.down_proj": (64, 128), "lm_head": (64, 64)}  # fmt: skip
    weights = {name: _weight(i, n, k) for i, (name, (n, k)) in enumerate(parts.items())}
    source, path = _source(tmp_path), tmp_path / "packed.safetensors"
    cold_model, cold = _tiny_decoder(), PackCache(path, source)
    install_quantized(cold_model, dict(weights), reference=True, pack_cache=cold)
    assert (cold.hits, cold.misses) == (0, 5) and path.is_file()  # qkv, o, gate_up, down, lm_head

    warm_model, warm = _tiny_decoder(), PackCache(path, source)
    install_quantized(warm_model, dict(weights), reference=True, pack_cache=warm)
    assert (warm.hits, warm.misses) == (5, 0)
    layers = {name: m for name, m in cold_model.named_modules() if isinstance(m, QuantLinear)}
    assert len(layers) == 5
    for name, layer in layers.items():
        other = warm_model.get_submodule(name)
        assert other.meta == layer.meta
        for key, tensor in layer.packed.items():
            assert torch.equal(other.packed[key], tensor), (name, key)
    x = torch.randn(3, 64)
    qkv = "model.layers.0.self_attn.qkv_proj"
    assert torch.equal(warm_model.get_submodule(qkv)(x), layers[qkv](x))

"""load_model: sources, dtype choice, dummy weights and the typed errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from sonar.models import loader
from sonar.models.errors import ModelLoadError, UnsupportedArchitectureError
from sonar.models.loader import bfloat16_emulated, cached_tokenizer_dir, load_model, resolve_dtype


@pytest.fixture
def llama_copy(tiny_checkpoints: dict[str, Any], tmp_path: Path) -> Path:
    """A writable copy of the tiny Llama checkpoint, to break in a test."""
    return Path(shutil.copytree(tiny_checkpoints["llama3"].path, tmp_path / "llama"))


def test_missing_path() -> None:
    with pytest.raises(ModelLoadError, match="model path /no/such/model does not exist"):
        load_model("/no/such/model")
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model("./not-here.gguf")


def test_model_id_absent_from_the_local_cache(tmp_path: Path) -> None:
    """HF_HUB_OFFLINE (set by the model tests' conftest) forbids the download (`tests/models/test_hub.py`)."""
    with pytest.raises(ModelLoadError) as caught:
        load_model("nobody/nothing", download_dir=tmp_path)
    message = str(caught.value)
    assert (
        f"model 'nobody/nothing' (revision main) is not a local path and is not in the Hugging Face cache at {tmp_path}"
        in message
    )
    assert "HF_HUB_OFFLINE forbids downloading it" in message


def test_model_id_found_in_the_local_cache(tiny_checkpoints: dict[str, Any], tmp_path: Path) -> None:
    """The layout huggingface_hub writes: refs/main names a snapshot folder holding the files."""
    repo = tmp_path / "models--tiny--qwen2"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(tiny_checkpoints["qwen2"].path, repo / "snapshots" / commit)
    loaded = load_model("tiny/qwen2", download_dir=tmp_path, dtype="float32")
    assert loaded.architecture == "Qwen2ForCausalLM"
    assert "tiny/qwen2" in loaded.source


def test_unknown_architecture(llama_copy: Path) -> None:
    config = json.loads((llama_copy / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (llama_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="unsupported model architecture: GPT2LMHeadModel"):
        load_model(str(llama_copy))


def test_unknown_model_type(llama_copy: Path) -> None:
    config = json.loads((llama_copy / "config.json").read_text())
    config.update(architectures=["FancyNewLM"], model_type="fancy-new-lm")
    (llama_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="FancyNewLM \\(model_type .fancy-new-lm.\\)"):
        load_model(str(llama_copy))


def test_corrupt_safetensors_header(llama_copy: Path) -> None:
    (llama_copy / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(ModelLoadError, match=r"corrupt safetensors file .*model\.safetensors"):
        load_model(str(llama_copy))


def test_truncated_safetensors(llama_copy: Path) -> None:
    path = llama_copy / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=r"corrupt safetensors file .*model\.safetensors"):
        load_model(str(llama_copy))


def test_missing_weight(llama_copy: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = llama_copy / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(path))
    with pytest.raises(ModelLoadError, match=r"lacks weights for model\.layers\.1\.self_attn\.qkv_proj\.weight"):
        load_model(str(llama_copy))


def test_sharded_checkpoint(tiny_checkpoints: dict[str, Any], tmp_path: Path) -> None:
    tiny = tiny_checkpoints["mistral"]
    tiny.hf.save_pretrained(str(tmp_path), max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    sharded = load_model(str(tmp_path), dtype="float32").model.state_dict()
    whole = load_model(str(tiny.path), dtype="float32").model.state_dict()
    assert sharded.keys() == whole.keys()
    assert all(torch.equal(sharded[k], whole[k]) for k in whole)


def test_missing_shard(tiny_checkpoints: dict[str, Any], tmp_path: Path) -> None:
    tiny_checkpoints["mistral"].hf.save_pretrained(str(tmp_path), max_shard_size="100KB")
    sorted(tmp_path.glob("*.safetensors"))[0].unlink()
    with pytest.raises(ModelLoadError, match="names shards that are missing"):
        load_model(str(tmp_path))


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_model(str(tmp_path))


def test_bad_arguments(tiny_checkpoints: dict[str, Any]) -> None:
    path = str(tiny_checkpoints["qwen2"].path)
    with pytest.raises(ModelLoadError, match="unknown dtype 'float64'"):
        load_model(path, dtype="float64")
    with pytest.raises(ModelLoadError, match="load_format 'tensorizer' is not supported"):
        load_model(path, load_format="tensorizer")


def test_dummy_weights(tiny_checkpoints: dict[str, Any]) -> None:
    from sonar.kernels.attention import AttentionMetadata, allocate_kv_caches

    tiny = tiny_checkpoints["qwen3"]
    loaded = load_model(str(tiny.path), load_format="dummy", dtype="float32")
    model = loaded.model
    real = dict(tiny.hf.named_parameters())
    assert not torch.equal(model.model.embed_tokens.weight, real["model.embed_tokens.weight"])
    assert model.lm_head.weight is model.model.embed_tokens.weight
    caches = allocate_kv_caches(model.num_layers, 4, 8, model.num_kv_heads, model.head_dim, torch.float32)
    meta = AttentionMetadata.build([5], [5], [[2]], 8)
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.arange(5), torch.arange(5), caches, meta))
    assert logits.shape == (5, loaded.config.vocab_size) and logits.isfinite().all()


def test_dtype_auto(tiny_checkpoints: dict[str, Any], llama_copy: Path) -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", torch.float32, gpu) == torch.float16
    assert resolve_dtype("auto", torch.float16, gpu) == torch.float16
    assert resolve_dtype("auto", torch.bfloat16, gpu) == torch.bfloat16
    assert resolve_dtype("auto", None, gpu) == torch.float16
    served = torch.float32 if bfloat16_emulated(cpu) else torch.bfloat16
    assert resolve_dtype("auto", torch.float32, cpu) == served
    assert resolve_dtype("auto", torch.bfloat16, cpu) == served
    assert resolve_dtype("float32", torch.bfloat16, cpu) == torch.float32
    assert resolve_dtype("bfloat16", torch.float32, cpu) == torch.bfloat16  # honoured, with a warning if emulated
    loaded = load_model(str(tiny_checkpoints["qwen2"].path))
    assert loaded.dtype == served
    assert all(p.dtype == served for p in loaded.model.parameters())


@pytest.mark.parametrize("emulated", [False, True])
def test_dtype_auto_follows_the_cpus_bfloat16(emulated: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """auto picks float32 where bfloat16 products are emulated (AVX2-only CPUs), bfloat16 where the
    CPU multiplies it natively; an explicit dtype is kept either way; a GPU is unaffected."""
    monkeypatch.setattr(loader, "bfloat16_emulated", lambda device: emulated and device.type == "cpu")
    cpu = torch.device("cpu")
    for checkpoint in (torch.float32, torch.bfloat16, torch.float16, None):
        assert resolve_dtype("auto", checkpoint, cpu) == (torch.float32 if emulated else torch.bfloat16)
    assert resolve_dtype("bfloat16", None, cpu) == torch.bfloat16
    assert resolve_dtype("auto", torch.bfloat16, torch.device("cuda")) == torch.bfloat16


def test_bfloat16_emulated_reads_the_cpu() -> None:
    """The answer is oneDNN's: not emulated with AVX512-BF16 or AMX, emulated without AVX-512 and
    AVX-NE-CONVERT (an AVX2-only CPU); between the two (AVX-512 without BF16) it is oneDNN's call."""
    from sonar.kernels import native

    flags = native.cpu_flags()
    if {"avx512_bf16", "amx_bf16"} & flags:
        assert not bfloat16_emulated(torch.device("cpu"))
    elif flags and not {"avx512f", "avx_ne_convert"} & flags:
        assert bfloat16_emulated(torch.device("cpu"))
    assert not bfloat16_emulated(torch.device("cuda"))


def test_embedded_default(smollm2_fp32: Any) -> None:
    loaded = smollm2_fp32
    assert loaded.architecture == "LlamaForCausalLM"
    assert "embedded SmolLM2-135M-Instruct" in loaded.source
    assert loaded.config.tie_word_embeddings and loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    assert loaded.eos_token_ids == [2]
    tok = loaded.load_tokenizer()
    assert tok.chat_template
    assert tok.decode(tok("Hello world").input_ids) == "Hello world"


def test_tokenizer_dir_told_before_loading(smollm2_fp32: Any, tiny_checkpoints: dict[str, Any], tmp_path: Path) -> None:
    """What the engine prefetches is the directory the load reports; unknown ones are None."""
    assert cached_tokenizer_dir(None) == smollm2_fp32.tokenizer_path
    qwen2 = tiny_checkpoints["qwen2"].path
    assert cached_tokenizer_dir(str(qwen2)) is None and load_model(str(qwen2)).tokenizer_path is None
    with_tokenizer = tmp_path / "qwen2"
    shutil.copytree(qwen2, with_tokenizer)
    shutil.copy(smollm2_fp32.tokenizer_path / "tokenizer.json", with_tokenizer)
    assert cached_tokenizer_dir(str(with_tokenizer)) == load_model(str(with_tokenizer)).tokenizer_path
    assert cached_tokenizer_dir(str(tmp_path / "absent")) is None
    assert cached_tokenizer_dir("HuggingFaceTB/SmolLM2-135M-Instruct") is None

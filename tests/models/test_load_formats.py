"""Load formats: dummy weights from a config alone, sharded safetensors read in one thread or a
pool of readers, PyTorch ``.bin`` files, the refusals; and that no code of a model repository runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from sonar.models import weights
from sonar.models.errors import ModelLoadError, UnsupportedArchitectureError
from sonar.models.loader import load_model
from sonar.models.weights import iter_safetensors, iter_safetensors_parallel, safetensors_files
from tests.models.driver import GreedyDriver

PROMPTS = [[5, 9, 2, 77, 31], [100, 3]]


def _same_weights(a: Any, b: Any) -> bool:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture(scope="module")
def sharded(tiny_checkpoints: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Mistral saved in shards of at most 100 KB (a dozen files)."""
    path = tmp_path_factory.mktemp("sharded")
    tiny_checkpoints["mistral"].hf.save_pretrained(str(path), max_shard_size="100KB")
    assert len(list(path.glob("*.safetensors"))) > 4
    return path


@pytest.fixture(scope="module")
def whole(tiny_checkpoints: dict[str, Any]) -> Any:
    return load_model(str(tiny_checkpoints["mistral"].path), dtype="float32")


def test_dummy_needs_only_the_config(tmp_path: Path) -> None:
    from transformers import Qwen3Config

    Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        architectures=["Qwen3ForCausalLM"],
    ).save_pretrained(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
    with pytest.raises(ModelLoadError, match="no \\*.safetensors weights"):
        load_model(str(tmp_path))
    first = load_model(str(tmp_path), load_format="dummy", dtype="float32")
    again = load_model(str(tmp_path), load_format="dummy", dtype="float32")
    assert _same_weights(first, again)  # drawn with a fixed seed
    driver = GreedyDriver(first.model, torch.float32, num_blocks=64, block_size=4)
    gen = driver.generate(PROMPTS, 5)
    assert [len(t) for t in gen.tokens] == [5, 5]
    assert all(logits.isfinite().all() for logits in gen.logits)


@pytest.mark.parametrize(
    "options",
    [
        {"load_format": "safetensors"},
        {"load_format": "auto", "safetensors_load_strategy": "eager"},
        {"load_format": "runai_streamer"},
        {"load_format": "runai_streamer", "model_loader_extra_config": {"concurrency": 1}},
        {"load_format": "runai_streamer", "model_loader_extra_config": {"concurrency": 3}},
    ],
    ids=["safetensors", "eager", "parallel-8", "parallel-1", "parallel-3"],
)
def test_sharded_checkpoint_loads_as_the_whole(sharded: Path, whole: Any, options: dict[str, Any]) -> None:
    assert _same_weights(load_model(str(sharded), dtype="float32", **options), whole)


def test_parallel_reader_yields_each_tensor_once(sharded: Path) -> None:
    files = safetensors_files(sharded)
    serial = dict(iter_safetensors(files))
    names = [name for name, _ in iter_safetensors_parallel(files, 3)]
    assert sorted(names) == sorted(serial) and len(set(names)) == len(names)
    parallel = dict(iter_safetensors_parallel(files, 4))
    assert all(torch.equal(parallel[k], serial[k]) for k in serial)


def test_parallel_reader_memory_is_bounded(sharded: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the consumer is slow, readers stay at most 3 x concurrency tensors ahead of it: the
    queue's 2 x concurrency and one in each reader's hand."""
    read = weights._iter_mapped
    produced = 0
    lock = threading.Lock()

    def counted(path: Path):
        nonlocal produced
        for item in read(path):
            with lock:
                produced += 1
            yield item

    monkeypatch.setattr(weights, "_iter_mapped", counted)
    concurrency, consumed, ahead = 2, 0, 0
    for _ in iter_safetensors_parallel(safetensors_files(sharded), concurrency):
        time.sleep(0.005)
        consumed += 1
        with lock:
            ahead = max(ahead, produced - consumed)
    assert consumed == produced > 6 * concurrency
    assert ahead <= 3 * concurrency


def _readers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("weights-reader")]


def test_parallel_reader_stops_on_error_and_when_abandoned(sharded: Path, tmp_path: Path) -> None:
    import shutil

    broken = Path(shutil.copytree(sharded, tmp_path / "broken"))
    shard = sorted(broken.glob("*.safetensors"))[2]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=f"corrupt safetensors file .*{shard.name}"):
        load_model(str(broken), load_format="runai_streamer", model_loader_extra_config={"concurrency": 3})
    assert _readers() == []
    stream = iter_safetensors_parallel(safetensors_files(sharded), 3)
    next(stream)
    stream.close()
    assert _readers() == []


def _save_bin_shards(state: dict[str, torch.Tensor], folder: Path, shards: int) -> None:
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        file = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = {n: state[n].clone() for n in names[i::shards]}
        torch.save(part, folder / file)
        weight_map.update(dict.fromkeys(part, file))
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_pt_weights(tiny_checkpoints: dict[str, Any], whole: Any, tmp_path: Path) -> None:
    tiny = tiny_checkpoints["mistral"]
    (tmp_path / "config.json").write_bytes((tiny.path / "config.json").read_bytes())
    _save_bin_shards(tiny.hf.state_dict(), tmp_path, 3)
    assert _same_weights(load_model(str(tmp_path), load_format="pt", dtype="float32"), whole)
    # auto falls back to .bin weights where there are no safetensors ones
    assert _same_weights(load_model(str(tmp_path), dtype="float32"), whole)
    with pytest.raises(ModelLoadError, match="no \\*.safetensors weights"):
        load_model(str(tmp_path), load_format="safetensors")


class _Payload:
    """A pickle that would create a file when loaded (what a malicious checkpoint does)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (Path.touch, (self.marker,))


def test_pt_runs_no_pickled_code(tiny_checkpoints: dict[str, Any], tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    (tmp_path / "config.json").write_bytes((tiny_checkpoints["mistral"].path / "config.json").read_bytes())
    torch.save({"model.embed_tokens.weight": _Payload(marker)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="loaded with weights_only=True"):
        load_model(str(tmp_path), load_format="pt")
    assert not marker.exists()


def test_refusals(tiny_checkpoints: dict[str, Any]) -> None:
    path = str(tiny_checkpoints["qwen2"].path)
    for name in ("tensorizer", "bitsandbytes", "sharded_state", "npcache"):
        with pytest.raises(ModelLoadError, match=f"load_format '{name}' is not supported"):
            load_model(path, load_format=name)
    with pytest.raises(ModelLoadError, match="load_format runai_streamer has no setting \\['memory_limit'\\]"):
        load_model(path, load_format="runai_streamer", model_loader_extra_config={"memory_limit": 1})
    with pytest.raises(ModelLoadError, match="load_format safetensors has no setting \\['concurrency'\\]"):
        load_model(path, load_format="safetensors", model_loader_extra_config={"concurrency": 2})
    with pytest.raises(ModelLoadError, match="concurrency must be a positive integer, got 0"):
        load_model(path, load_format="runai_streamer", model_loader_extra_config={"concurrency": 0})
    with pytest.raises(ModelLoadError, match="safetensors_load_strategy 'prefetch' is not supported"):
        load_model(path, safetensors_load_strategy="prefetch")
    with pytest.raises(ModelLoadError, match="tokenizer_revision v2: directory .* is local"):
        load_model(path, tokenizer_revision="v2")


def test_ignore_patterns_skip_weight_files(sharded: Path, whole: Any, tmp_path: Path) -> None:
    import shutil

    folder = Path(shutil.copytree(sharded, tmp_path / "m"))
    (folder / "model.safetensors.index.json").unlink()
    (folder / "original").mkdir()
    with pytest.raises(ModelLoadError, match="leave no weight files"):
        load_model(str(folder), ignore_patterns=["*.safetensors"])
    with pytest.raises(ModelLoadError, match="checkpoint lacks weights"):
        load_model(str(folder), ignore_patterns=["model-00001-*"])
    assert _same_weights(load_model(str(folder), dtype="float32", ignore_patterns=["original/**/*"]), whole)


REMOTE_CODE = """
from pathlib import Path
Path({marker!r}).write_text("remote code ran")
from transformers import LlamaConfig


class EvilConfig(LlamaConfig):
    model_type = "evil"
"""


def _with_remote_code(folder: Path, marker: Path, config_changes: dict[str, Any]) -> None:
    """A repository whose config and tokenizer name Python files (auto_map) that would write `marker`."""
    from tests.engine.conftest import save_word_tokenizer

    for name in ("configuration_evil.py", "modeling_evil.py", "tokenization_evil.py"):
        (folder / name).write_text(REMOTE_CODE.format(marker=str(marker)))
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {
        "AutoConfig": "configuration_evil.EvilConfig",
        "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM",
    }
    config.update(config_changes)
    (folder / "config.json").write_text(json.dumps(config))
    save_word_tokenizer(folder, config["vocab_size"])
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))


def test_trust_remote_code_never_runs_repository_code(tiny_checkpoints: dict[str, Any], tmp_path: Path) -> None:
    import shutil

    from sonar.cli import parse_serve_args
    from sonar.engine import tokenizers

    marker = tmp_path / "marker"
    llama = Path(shutil.copytree(tiny_checkpoints["llama3"].path, tmp_path / "llama"))
    _with_remote_code(llama, marker, {})
    config = parse_serve_args([str(llama), "--trust-remote-code"])
    assert config.model == str(llama)  # accepted: the permission is never used
    loaded = load_model(str(llama), dtype="float32")
    assert loaded.architecture == "LlamaForCausalLM"
    assert loaded.load_tokenizer()("w3 w4").input_ids == [3, 4]
    assert tokenizers.load(str(llama))("w5").input_ids == [5]
    assert not marker.exists()
    # an architecture Sonar does not implement is refused before anything reads the code
    other = Path(shutil.copytree(tiny_checkpoints["llama3"].path, tmp_path / "evil"))
    _with_remote_code(other, marker, {"architectures": ["EvilForCausalLM"], "model_type": "evil"})
    with pytest.raises(UnsupportedArchitectureError, match="EvilForCausalLM"):
        load_model(str(other))
    assert not marker.exists()
    # the repository's code does run where transformers is told to trust it: the check above can fail
    script = "import sys; from transformers import AutoConfig; AutoConfig.from_pretrained(sys.argv[1], trust_remote_code=True)"
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, "-c", script, str(other)], env=env, check=True, capture_output=True, timeout=120)
    assert marker.read_text() == "remote code ran"


def test_load_flags_reach_the_engine_config() -> None:
    from sonar.cli import parse_serve_args

    engine = parse_serve_args(
        [
            "org/model",
            "--load-format",
            "runai_streamer",
            "--model-loader-extra-config",
            '{"concurrency": 3}',
            "--hf-token",
            "hf_abc",
            "--ignore-patterns",
            "original/*",
            "*.pth",
            "--safetensors-load-strategy",
            "eager",
            "--tokenizer-revision",
            "v2",
            "--download-dir",
            "/tmp/hub",
            "--revision",
            "v1",
        ]
    ).engine
    assert engine.load_format == "runai_streamer" and engine.model_loader_extra_config == {"concurrency": 3}
    assert engine.hf_token == "hf_abc" and engine.ignore_patterns == ["original/*", "*.pth"]
    assert engine.safetensors_load_strategy == "eager" and engine.tokenizer_revision == "v2"
    assert engine.download_dir == "/tmp/hub" and engine.revision == "v1"

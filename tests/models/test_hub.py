"""Loading a hub id: the real `huggingface_hub` download code against a local server in the hub's
URL layout (`tests.models.hub_server`), pointed at with ``HF_ENDPOINT``; never the real hub."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from sonar.models.errors import ModelLoadError
from sonar.models.loader import load_model
from tests.engine.conftest import save_word_tokenizer, spread_weights
from tests.models.driver import GreedyDriver
from tests.models.hub_server import Hub

REPO = "tiny/llama"
GATED = "gated/llama"
TOKEN = "hf_s3cret"
PROMPTS = [[5, 9, 2, 77, 31], [100, 3]]


def _save(folder: Path, seed: int, *, with_bin: bool = False) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(config).eval()
    spread_weights(hf)
    hf.save_pretrained(str(folder))
    save_word_tokenizer(folder, config.vocab_size)
    if with_bin:  # what older repositories hold beside (or instead of) safetensors
        torch.save(hf.state_dict(), folder / "pytorch_model.bin")
    (folder / "README.md").write_text("a tiny random Llama\n")
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hub-folders")
    return {"main": _save(root / "main", 1, with_bin=True), "v1": _save(root / "v1", 2)}


@pytest.fixture(scope="module")
def hub(folders: dict[str, Path]) -> Iterator[Hub]:
    with Hub() as server:
        repo = server.repo(REPO)
        repo.add_commit(folders["v1"], "v1")
        repo.add_commit(folders["main"], "main")
        server.repo(GATED, token=TOKEN).add_commit(folders["main"], "main")
        yield server


@pytest.fixture
def online(hub: Hub, monkeypatch: pytest.MonkeyPatch) -> Hub:
    """This process online, with the local server as its hub (the model tests' conftest sets
    HF_HUB_OFFLINE, which huggingface_hub may have read at import)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", "/nonexistent/token")
    hub.requests.clear()
    return hub


def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def _greedy(loaded: Any) -> list[list[int]]:
    return GreedyDriver(loaded.model, torch.float32, num_blocks=64, block_size=4).generate(PROMPTS, 6).tokens


def _same_weights(a: Any, b: Any) -> bool:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_download_then_load_generates_as_the_folder(online: Hub, folders: dict[str, Path], tmp_path: Path) -> None:
    loaded = load_model(REPO, download_dir=tmp_path, dtype="float32")
    assert loaded.model_dir.is_relative_to(tmp_path / "models--tiny--llama" / "snapshots")
    assert REPO in loaded.source
    direct = load_model(str(folders["main"]), dtype="float32")
    assert _greedy(loaded) == _greedy(direct)
    # safetensors only: neither the .bin weights nor the README came down
    files = sorted(p.name for p in loaded.model_dir.iterdir())
    assert "model.safetensors" in files and "tokenizer.json" in files and "config.json" in files
    assert "pytorch_model.bin" not in files and "README.md" not in files
    assert not any(r.path.endswith(("pytorch_model.bin", "README.md")) for r in online.requests)
    assert loaded.tokenizer_path == loaded.model_dir
    assert loaded.load_tokenizer()("w5 w9").input_ids == [5, 9]


def test_second_load_offline_from_the_cache(
    online: Hub, folders: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = load_model(REPO, download_dir=tmp_path, dtype="float32")
    _offline(monkeypatch)
    online.requests.clear()
    second = load_model(REPO, download_dir=tmp_path, dtype="float32")
    assert online.requests == []
    assert second.model_dir == first.model_dir and _same_weights(first, second)
    with pytest.raises(ModelLoadError) as caught:  # a revision the cache never saw
        load_model(REPO, revision="v1", download_dir=tmp_path)
    assert online.requests == []
    message = str(caught.value)
    assert f"model {REPO!r} (revision v1)" in message and str(tmp_path) in message
    assert "HF_HUB_OFFLINE forbids downloading it" in message


def test_missing_repository(online: Hub, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as caught:
        load_model("nobody/nothing", download_dir=tmp_path)
    message = str(caught.value)
    assert f"model 'nobody/nothing' (revision main) was not found on the hub at {online.url}" in message
    assert f"the Hugging Face cache at {tmp_path}" in message
    assert "HF_TOKEN" in message  # a private repository reads as missing without a token


def test_unreachable_hub(online: Hub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(ModelLoadError) as caught:
        load_model(REPO, download_dir=tmp_path)
    message = str(caught.value)
    assert f"model {REPO!r} (revision main) is not in the Hugging Face cache at {tmp_path}" in message
    assert f"the hub at http://127.0.0.1:{port} could not be reached" in message
    assert "check the network" in message


def test_revision_picks_its_commit(online: Hub, folders: dict[str, Path], tmp_path: Path) -> None:
    v1 = load_model(REPO, revision="v1", download_dir=tmp_path, dtype="float32")
    assert _same_weights(v1, load_model(str(folders["v1"]), dtype="float32"))
    main_sha = online.repos[REPO].refs["main"]
    by_sha = load_model(REPO, revision=main_sha, download_dir=tmp_path, dtype="float32")
    assert by_sha.model_dir.name == main_sha
    assert _same_weights(by_sha, load_model(str(folders["main"]), dtype="float32"))
    assert not _same_weights(v1, by_sha)
    with pytest.raises(ModelLoadError, match=f"model '{REPO}' \\(revision nope\\): the repository has no revision"):
        load_model(REPO, revision="nope", download_dir=tmp_path)


def test_gated_repository_needs_the_token(
    online: Hub, folders: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ModelLoadError) as caught:
        load_model(GATED, download_dir=tmp_path)
    message = str(caught.value)
    assert f"model {GATED!r} (revision main) is gated" in message and "set HF_TOKEN or pass --hf-token" in message
    assert str(tmp_path) in message
    with pytest.raises(ModelLoadError, match="is gated"):
        load_model(GATED, download_dir=tmp_path, hf_token="hf_wrong")
    online.requests.clear()
    loaded = load_model(GATED, download_dir=tmp_path, hf_token=TOKEN, dtype="float32")
    assert online.requests and all(r.authorization == f"Bearer {TOKEN}" for r in online.requests)
    assert _same_weights(loaded, load_model(str(folders["main"]), dtype="float32"))
    monkeypatch.setenv("HF_TOKEN", TOKEN)  # the environment's token, in a fresh cache
    assert load_model(GATED, download_dir=tmp_path / "env", dtype="float32", load_format="dummy")


def test_pt_downloads_the_bin_weights_only_when_asked(online: Hub, folders: dict[str, Path], tmp_path: Path) -> None:
    loaded = load_model(REPO, download_dir=tmp_path, dtype="float32", load_format="pt")
    files = {p.name for p in loaded.model_dir.iterdir()}
    assert "pytorch_model.bin" in files and "model.safetensors" not in files
    assert _same_weights(loaded, load_model(str(folders["main"]), dtype="float32"))


def test_dummy_downloads_no_weights(online: Hub, tmp_path: Path) -> None:
    loaded = load_model(REPO, download_dir=tmp_path, dtype="float32", load_format="dummy")
    assert not list(loaded.model_dir.glob("*.safetensors")) and not list(loaded.model_dir.glob("*.bin"))
    assert len(_greedy(loaded)[0]) == 6


def test_ignore_patterns_are_not_downloaded(online: Hub, tmp_path: Path) -> None:
    loaded = load_model(REPO, download_dir=tmp_path, dtype="float32", ignore_patterns=["generation_config.json"])
    assert not (loaded.model_dir / "generation_config.json").exists()
    assert not any(r.path.endswith("generation_config.json") for r in online.requests)


def test_safetensors_only_repository_refuses_other_formats(
    online: Hub, folders: dict[str, Path], tmp_path: Path
) -> None:
    bins_only = tmp_path / "bins"
    bins_only.mkdir()
    for name in ("config.json", "pytorch_model.bin"):
        (bins_only / name).write_bytes((folders["main"] / name).read_bytes())
    online.repo("old/llama").add_commit(bins_only, "main")
    with pytest.raises(ModelLoadError, match="has no safetensors weights .*only with --load-format pt"):
        load_model("old/llama", download_dir=tmp_path / "cache")
    assert load_model("old/llama", download_dir=tmp_path / "cache", load_format="pt").model is not None


SCRIPT = """
import json, sys
import torch
from sonar.models.loader import load_model
from tests.models.driver import GreedyDriver

loaded = load_model(sys.argv[1], download_dir=sys.argv[2], dtype="float32")
gen = GreedyDriver(loaded.model, torch.float32, num_blocks=64, block_size=4).generate(json.loads(sys.argv[3]), 6)
print(json.dumps({"tokens": gen.tokens, "dir": str(loaded.model_dir)}))
"""


def _run(env: dict[str, str], *args: str) -> dict[str, Any]:
    """The load in a process of its own, where huggingface_hub reads the environment at import."""
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parents[2],
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_fresh_processes_download_then_load_offline(hub: Hub, folders: dict[str, Path], tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_OFFLINE"))}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "home"))
    hub.requests.clear()
    online = _run(env, REPO, str(tmp_path / "cache"), json.dumps(PROMPTS))
    assert any("/resolve/" in r.path for r in hub.requests)
    assert online["tokens"] == _greedy(load_model(str(folders["main"]), dtype="float32"))
    hub.requests.clear()
    offline = _run({**env, "HF_HUB_OFFLINE": "1"}, REPO, str(tmp_path / "cache"), json.dumps(PROMPTS))
    assert hub.requests == []
    assert offline == online


def test_tokenizer_revision_downloads_its_tokenizer_files(online: Hub, tmp_path: Path) -> None:
    loaded = load_model(REPO, tokenizer_revision="v1", download_dir=tmp_path, dtype="float32")
    repo = online.repos[REPO]
    assert loaded.model_dir.name == repo.refs["main"]
    assert loaded.tokenizer_path is not None and loaded.tokenizer_path.name == repo.refs["v1"]
    files = {p.name for p in loaded.tokenizer_path.iterdir()}
    assert "tokenizer.json" in files and not any(f.endswith((".safetensors", ".bin")) for f in files)
    assert loaded.load_tokenizer()("w7").input_ids == [7]


@pytest.mark.anyio
async def test_engine_serves_a_gated_hub_model(online: Hub, folders: dict[str, Path], tmp_path: Path) -> None:
    """The engine's flags reach the download: `sonar.open` of a gated id with its token generates
    what the same folder loaded directly generates."""
    import sonar

    params = sonar.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    args: dict[str, Any] = dict(dtype="float32", num_gpu_blocks_override=32, enforce_eager=True)
    async with sonar.open(GATED, download_dir=str(tmp_path), hf_token=TOKEN, **args) as llm:
        served = [o.token_ids for o in await llm.generate_many(PROMPTS, params)]
    assert any(r.authorization == f"Bearer {TOKEN}" and "/resolve/" in r.path for r in online.requests)
    async with sonar.open(str(folders["main"]), **args) as llm:
        direct = [o.token_ids for o in await llm.generate_many(PROMPTS, params)]
    assert served == direct

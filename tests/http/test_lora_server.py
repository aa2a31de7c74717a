"""`sonar serve --enable-lora`: adapters named as a request's `model`, listed by /v1/models, and
loaded and unloaded at run time (POST /v1/load_lora_adapter, /v1/unload_lora_adapter, only with
``SONAR_ALLOW_RUNTIME_LORA_UPDATING=1``).

The adapters are made here with peft on the embedded SmolLM2 (dequantized to float32, as the
server serves it); an adapter's text must be transformers+peft's greedy text. One server (with
the switch and an API key) serves most of the module; one more starts without the switch, and one
is refused at startup for a bad ``--lora-modules`` folder.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import torch

from tests.http.conftest import (
    PLAIN_SERVER_ARGS,
    ROOT,
    ServerProcess,
    free_port,
    serving,
    sse_events,
    start_server,
    stop_server_cleanly,
)
from tests.lora.conftest import hf_greedy

PROMPT = "Once upon a time, in a small village by the sea,"
#: Over two KV blocks (16 tokens each): what the prefix cache may share, or must not.
LONG_PROMPT = (
    "The harbour master kept a ledger of every ship that came in: its name, its cargo, its captain, "
    "the day it arrived and the day it left. One winter morning a ship with no name arrived, and"
)
MESSAGES = [{"role": "user", "content": "Name a colour and a fruit."}]
NEW_TOKENS = 10
API_KEY = "lora-test-key"
SWITCH = "SONAR_ALLOW_RUNTIME_LORA_UPDATING"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: Adapter name -> (rank, seed). The server starts with a and c; b is loaded at run time.
ADAPTERS = {"a": (8, 1), "b": (8, 2), "c": (4, 3)}
LORA_ARGS = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "16")


@dataclass
class Adapters:
    folders: dict[str, Path]
    texts: dict[str | None, str]
    """transformers(+peft)'s greedy text for `PROMPT` by adapter (None: the base model)."""
    long_texts: dict[str | None, str]
    """The same for `LONG_PROMPT`, for the base model and adapter a."""
    chat_ids: list[int]
    """`MESSAGES` rendered by the tokenizer's chat template."""
    chat: str
    """The greedy reply to them with adapter a."""
    bad: dict[str, tuple[Path, str]]
    """Folders the server must refuse, each with a part of the reason it must give."""


@contextmanager
def _peft(hf: Any, rank: int, seed: int, targets: list[str]) -> Iterator[Any]:
    """A peft LoRA model on `hf` whose delta changes the text yet keeps it sane; `hf` gets its
    own modules back when the block ends (peft wraps the model it is given: no 0.5 GB copy)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
    model = get_peft_model(hf, config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(0.5)
    try:
        yield model
    finally:
        model.unload()


def _greedy(model: Any, ids: list[int]) -> list[int]:
    """`NEW_TOKENS` greedy tokens after `ids`, end-of-turn tokens included (`ignore_eos`)."""
    [tokens], _ = hf_greedy(model, [ids], NEW_TOKENS)
    return tokens


def _bad_folders(good: Path, hf: Any, root: Path) -> dict[str, tuple[Path, str]]:
    """Copies of adapter `good`, each broken in one way, and a high-rank adapter."""
    from safetensors.torch import load_file, save_file

    def copy_of(name: str) -> Path:
        return Path(shutil.copytree(good, root / name))

    no_config = copy_of("no-config")
    (no_config / "adapter_config.json").unlink()
    lm_head = copy_of("lm-head")
    tensors = load_file(lm_head / "adapter_model.safetensors")
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(8, hf.config.hidden_size)
    tensors["base_model.model.lm_head.lora_B.weight"] = torch.zeros(hf.config.vocab_size, 8)
    save_file(tensors, lm_head / "adapter_model.safetensors")
    pickled = copy_of("pickled")
    torch.save(load_file(pickled / "adapter_model.safetensors"), pickled / "adapter_model.bin")
    (pickled / "adapter_model.safetensors").unlink()
    high_rank = root / "rank-32"
    with _peft(hf, 32, 4, ["q_proj"]) as model:
        model.save_pretrained(str(high_rank))
    return {
        "no-config": (no_config, "adapter_config.json"),
        "lm-head": (lm_head, "lm_head"),
        "pickled": (pickled, "adapter_model.bin is refused"),
        "rank-32": (high_rank, "rank 32 exceeds --max-lora-rank 16"),
    }


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> Adapters:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sonar.models.loader import load_model

    model_dir = str(load_model(None, dtype="float32", dequantize_weights=True).model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)  # as the server's text does

    ids = tokenizer(PROMPT).input_ids
    root = tmp_path_factory.mktemp("adapters")
    folders: dict[str, Path] = {}
    long_ids = tokenizer(LONG_PROMPT).input_ids
    assert len(long_ids) > 32
    texts: dict[str | None, str] = {None: decode(_greedy(hf, ids))}
    long_texts: dict[str | None, str] = {None: decode(_greedy(hf, long_ids))}
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    chat_ids = tokenizer(rendered, add_special_tokens=False).input_ids
    chat = ""
    for name, (rank, seed) in ADAPTERS.items():
        folders[name] = root / name
        with _peft(hf, rank, seed, TARGETS) as model:
            model.save_pretrained(str(folders[name]))
            texts[name] = decode(_greedy(model, ids))
            if name == "a":
                chat = decode(_greedy(model, chat_ids))
                long_texts[name] = decode(_greedy(model, long_ids))
    assert len(set(texts.values())) == len(texts), f"two adapters give the same text: {texts}"
    return Adapters(folders, texts, long_texts, chat_ids, chat, _bad_folders(folders["a"], hf, root))


@pytest.fixture(scope="module")
def server(adapters: Adapters, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Adapters a and c from the start, the runtime switch on, an API key."""
    modules = (f"a={adapters.folders['a']}", f"c={adapters.folders['c']}")
    args = (*PLAIN_SERVER_ARGS, *LORA_ARGS, "--lora-modules", *modules, "--api-key", API_KEY)
    srv = start_server(tmp_path_factory.mktemp("lora"), *args, env={SWITCH: "1"})
    yield srv
    stop_server_cleanly(srv)


@pytest.fixture
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=120) as client:
        yield client


def complete(http: httpx.Client, model: str, max_tokens: int = NEW_TOKENS, **fields: Any) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return http.post("/v1/completions", json={**body, **fields})


def text_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def load(http: httpx.Client, name: str, path: Path, **fields: Any) -> httpx.Response:
    return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path), **fields})


def unload(http: httpx.Client, name: str) -> httpx.Response:
    return http.post("/v1/unload_lora_adapter", json={"lora_name": name})


def expect_error(response: httpx.Response, status: int, *fragments: str) -> dict[str, Any]:
    """OpenAI's error body, its message naming each of `fragments`."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert all(f in error["message"] for f in fragments), error
    return error


def listed(http: httpx.Client) -> dict[str, dict[str, Any]]:
    response = http.get("/v1/models")
    assert response.status_code == 200, response.text
    return {card["id"]: card for card in response.json()["data"]}


def test_models_lists_the_base_model_and_each_adapter(http: httpx.Client, adapters: Adapters) -> None:
    cards = listed(http)
    assert list(cards)[:3] == ["smol", "a", "c"]
    assert cards["smol"]["parent"] is None
    for name in ("a", "c"):
        assert cards[name]["parent"] == "smol" and cards[name]["root"] == str(adapters.folders[name])
        one = http.get(f"/v1/models/{name}")
        assert one.status_code == 200 and one.json()["id"] == name and one.json()["parent"] == "smol"
    error = expect_error(http.get("/v1/models/b"), 404, "`b`")
    assert error["code"] == "model_not_found"


def test_an_adapter_gives_peft_text(http: httpx.Client, adapters: Adapters) -> None:
    assert text_of(complete(http, "smol")) == adapters.texts[None]
    for name in ("a", "c"):
        response = complete(http, name)
        assert text_of(response) == adapters.texts[name], name
        assert response.json()["model"] == name  # the name asked for, as vLLM answers
    streamed = complete(http, "a", stream=True)
    assert streamed.status_code == 200, streamed.text
    chunks = [e for e in sse_events(streamed) if e != "[DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == adapters.texts["a"]
    assert chunks[0]["model"] == "a"
    expect_error(complete(http, "nope"), 404, "`nope`")


def test_the_prefix_cache_keeps_an_adapters_kv_apart(http: httpx.Client, adapters: Adapters) -> None:
    """Blocks are keyed by the adapter's digest: the base model's blocks of a prompt are not an
    adapter's, an adapter's are shared with its later requests, also under another name."""

    def run(model: str) -> tuple[str, int]:
        response = complete(http, model, prompt=LONG_PROMPT)
        return text_of(response), response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert run("smol")[0] == adapters.long_texts[None]
    assert run("a") == (adapters.long_texts["a"], 0)
    text, cached = run("a")
    assert text == adapters.long_texts["a"] and cached >= 32
    assert load(http, "a-again", adapters.folders["a"]).status_code == 200
    text, cached = run("a-again")
    assert text == adapters.long_texts["a"] and cached >= 32
    assert unload(http, "a-again").status_code == 200


def test_chat_and_responses_with_an_adapter(http: httpx.Client, adapters: Adapters) -> None:
    assert http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"] == adapters.chat_ids
    body = {"messages": MESSAGES, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    response = http.post("/v1/chat/completions", json={**body, "model": "a"})
    assert response.status_code == 200, response.text
    assert response.json()["model"] == "a"
    assert response.json()["choices"][0]["message"]["content"] == adapters.chat
    assert response.json()["usage"]["completion_tokens"] == NEW_TOKENS
    expect_error(http.post("/v1/chat/completions", json={**body, "model": "nope"}), 404, "`nope`")
    streamed = http.post("/v1/chat/completions", json={**body, "model": "a", "stream": True})
    chunks = [e for e in sse_events(streamed) if e != "[DONE]"]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == adapters.chat
    assert {c["model"] for c in chunks} == {"a"}
    response = http.post("/v1/responses", json={"model": "a", "input": "Hi", "max_output_tokens": 4})
    assert response.status_code == 200, response.text
    assert response.json()["model"] == "a"


def test_an_adapter_loaded_at_run_time_is_served_until_unloaded(http: httpx.Client, adapters: Adapters) -> None:
    response = load(http, "b", adapters.folders["b"])
    assert response.status_code == 200, response.text
    card = listed(http)["b"]
    assert card["parent"] == "smol" and card["root"] == str(adapters.folders["b"])
    assert text_of(complete(http, "b")) == adapters.texts["b"]
    expect_error(load(http, "b", adapters.folders["c"]), 400, "already loaded")
    expect_error(load(http, "smol", adapters.folders["c"]), 400, "base model")
    assert text_of(complete(http, "b")) == adapters.texts["b"]  # the refused load changed nothing

    assert unload(http, "b").status_code == 200
    assert "b" not in listed(http)
    expect_error(complete(http, "b"), 404, "`b`")
    expect_error(unload(http, "b"), 404, "`b`")


@pytest.mark.parametrize("kind", ["no-config", "lm-head", "pickled", "rank-32"])
def test_a_bad_adapter_is_refused_with_the_reason(http: httpx.Client, adapters: Adapters, kind: str) -> None:
    folder, reason = adapters.bad[kind]
    error = expect_error(load(http, f"bad-{kind}", folder), 400, reason)
    assert error["code"] == 400
    assert f"bad-{kind}" not in listed(http)
    expect_error(complete(http, f"bad-{kind}"), 404)


def test_load_inplace_replaces_the_adapter(http: httpx.Client, adapters: Adapters) -> None:
    assert load(http, "x", adapters.folders["b"]).status_code == 200
    assert text_of(complete(http, "x")) == adapters.texts["b"]
    response = load(http, "x", adapters.folders["c"], load_inplace=True)
    assert response.status_code == 200, response.text
    assert listed(http)["x"]["root"] == str(adapters.folders["c"])
    assert text_of(complete(http, "x")) == adapters.texts["c"]
    # a failed replacement keeps the adapter that was there
    expect_error(load(http, "x", adapters.bad["no-config"][0], load_inplace=True), 400, "adapter_config.json")
    assert text_of(complete(http, "x")) == adapters.texts["c"]
    assert unload(http, "x").status_code == 200


def test_the_lora_routes_need_the_api_key(server: ServerProcess, adapters: Adapters) -> None:
    body = {"lora_name": "k", "lora_path": str(adapters.folders["b"])}
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            assert httpx.post(f"{server.base_url}{path}", json=body, headers=headers).status_code == 401
    headers = {"Authorization": f"Bearer {API_KEY}"}
    assert "k" not in listed(httpx.Client(base_url=server.base_url, headers=headers))


def test_loading_and_unloading_under_load_loses_no_request(http: httpx.Client, adapters: Adapters) -> None:
    """8 requests (half streamed) on adapter a and the base model decode while b is loaded, used
    and unloaded (while its own request streams: that request keeps b to its end): each completes
    with every token it asked for."""
    tokens = 64
    results: dict[int, tuple[int, int]] = {}
    ended: dict[int, float] = {}

    def one(i: int) -> None:
        model, stream = ("a" if i % 2 else "smol"), i % 4 >= 2
        body = {"model": model, "prompt": f"{i}: {PROMPT}", "max_tokens": tokens, "ignore_eos": True}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
            with http.stream("POST", "/v1/completions", json=body) as response:
                events = sse_events(response) if response.status_code == 200 else []
                usage = next(e["usage"] for e in reversed(events) if e != "[DONE]" and e.get("usage"))
                results[i] = (response.status_code, usage["completion_tokens"])
        else:
            response = http.post("/v1/completions", json=body)
            results[i] = (response.status_code, response.json()["usage"]["completion_tokens"])
        ended[i] = time.monotonic()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while http.get("/load").json()["server_load"] < 8:  # all 8 in flight
        assert time.monotonic() < deadline, "the 8 requests did not all start"
        time.sleep(0.05)
    assert load(http, "b", adapters.folders["b"]).status_code == 200
    body = {"model": "b", "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        lines = (line for line in response.iter_lines() if line.startswith("data: {"))
        first = json.loads(next(lines)[len("data: ") :])
        assert unload(http, "b").status_code == 200
        unloaded = time.monotonic()
        rest = [json.loads(line[len("data: ") :]) for line in lines]
    assert "".join(c["choices"][0]["text"] for c in [first, *rest]) == adapters.texts["b"]
    expect_error(complete(http, "b"), 404, "`b`")
    for thread in threads:
        thread.join(timeout=120)
    assert results == {i: (200, tokens) for i in range(8)}
    assert max(ended.values()) > unloaded, "every request ended before the unload: nothing was under load"


def test_without_the_switch_the_routes_are_absent(adapters: Adapters, tmp_path: Path) -> None:
    args = (*PLAIN_SERVER_ARGS, *LORA_ARGS, "--lora-modules", f"a={adapters.folders['a']}")
    with serving(tmp_path, *args, env={SWITCH: "0"}) as srv:
        with httpx.Client(base_url=srv.base_url, timeout=120) as http:
            assert load(http, "b", adapters.folders["b"]).status_code == 404
            assert unload(http, "a").status_code == 404
            assert text_of(complete(http, "a")) == adapters.texts["a"]
            assert "b" not in listed(http)


def test_a_bad_lora_module_fails_the_start(adapters: Adapters) -> None:
    folder, reason = adapters.bad["no-config"]
    args = (*PLAIN_SERVER_ARGS, *LORA_ARGS, "--lora-modules", f"broken={folder}")
    done = subprocess.run(
        [sys.executable, "-m", "sonar", "serve", "--host", "127.0.0.1", "--port", str(free_port()), *args],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0, done.stderr[-4000:]
    error = done.stderr.splitlines()[-1]
    assert error.startswith("sonar serve: error: LoRAError") and str(folder) in error and reason in error, error

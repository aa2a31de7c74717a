"""Per-token pooling over HTTP from a real `python -m sonar serve`: a tiny BertForTokenClassification
(``token_classify`` over /pooling; /classify, /v1/embeddings and /score answer 400 saying why) and
a tiny Qwen3ForSequenceClassification served with ``--convert reward`` (per-token rewards over
/pooling), against transformers on the same weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import torch

from tests.chaos.test_schema import CHECKS, run_schemathesis
from tests.http.conftest import ServerProcess, start_server, stop_server_cleanly
from tests.models.tiny_pooling import save_tiny_bert, save_tiny_decoder_classifier

TEXTS = ["the capital of france is paris", "a cat sat on the mat"]
FLAGS = ("--dtype", "float32", "--num-gpu-blocks-override", "64", "--disable-uvicorn-access-log")


def serve(tmp: Path, model: Path, *args: str) -> Iterator[tuple[httpx.Client, ServerProcess]]:
    srv: ServerProcess = start_server(tmp, str(model), *FLAGS, *args)
    try:
        with httpx.Client(base_url=srv.base_url, timeout=60) as client:
            yield client, srv
    finally:
        stop_server_cleanly(srv)


@pytest.fixture(scope="module")
def token_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[httpx.Client, ServerProcess, Any, Path]]:
    path = tmp_path_factory.mktemp("bert-ner")
    hf = save_tiny_bert(path, "bert", num_labels=3, head="token", id2label={0: "O", 1: "B-LOC", 2: "I-LOC"})
    for client, srv in serve(tmp_path_factory.mktemp("srv"), path):
        yield client, srv, hf, path


@pytest.fixture(scope="module")
def token_classifier(token_server: tuple[httpx.Client, ServerProcess, Any, Path]) -> tuple[httpx.Client, Any, Path]:
    client, _, hf, path = token_server
    return client, hf, path


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[httpx.Client, Any]]:
    path = tmp_path_factory.mktemp("qwen3-rm")
    hf = save_tiny_decoder_classifier(path, "qwen3", num_labels=1)
    for client, _ in serve(tmp_path_factory.mktemp("srv"), path, "--convert", "reward"):
        yield client, hf


def test_token_classification_over_pooling(token_classifier: tuple[httpx.Client, Any, Path]) -> None:
    from transformers import AutoTokenizer

    http, hf, path = token_classifier
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    r = http.post("/pooling", json={"input": TEXTS})  # the model's task: token_classify
    assert r.status_code == 200, r.text
    body = r.json()
    raw = http.post("/pooling", json={"input": TEXTS[0], "task": "token_classify", "use_activation": False})
    assert raw.status_code == 200, raw.text
    for text, item in zip(TEXTS, body["data"]):
        with torch.no_grad():
            expected = hf(**tokenizer(text, return_tensors="pt")).logits[0]
        assert (torch.tensor(item["data"]) - expected.softmax(-1)).abs().max() < 1e-5
        if text == TEXTS[0]:
            assert (torch.tensor(raw.json()["data"][0]["data"]) - expected).abs().max() < 1e-4
    assert body["usage"]["prompt_tokens"] == sum(len(tokenizer(t).input_ids) for t in TEXTS)


@pytest.mark.parametrize(
    ("path", "payload", "param", "message"),
    [
        ("/classify", {"input": "water"}, "task", "token classifier"),
        ("/v1/embeddings", {"input": "water"}, "task", "token_classify task"),
        ("/pooling", {"input": "water", "task": "token_embed"}, "task", "--convert embed"),
        ("/pooling", {"input": "water", "normalize": True}, "normalize", "normalize applies to embeddings only"),
        ("/score", {"text_1": "water", "text_2": "paris"}, "model", "cannot score"),
    ],
)
def test_token_classifier_refuses_other_tasks_by_name(
    token_classifier: tuple[httpx.Client, Any, Path], path: str, payload: dict[str, Any], param: str, message: str
) -> None:
    http, _, _ = token_classifier
    r = http.post(path, json=payload)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"]


def test_rewards_over_pooling(reward_model: tuple[httpx.Client, Any]) -> None:
    http, hf = reward_model
    ids = [5, 9, 13, 2, 8, 21]
    r = http.post("/pooling", json={"input": [ids]})
    assert r.status_code == 200, r.text
    got = torch.tensor(r.json()["data"][0]["data"])
    with torch.no_grad():
        expected = hf.score(hf.model(torch.tensor([ids])).last_hidden_state)[0]
        reward = hf(torch.tensor([ids])).logits[0]
    assert got.shape == (len(ids), 1)
    assert (got - expected).abs().max() < 1e-4 and (got[-1] - reward).abs().max() < 1e-4
    refused = http.post("/classify", json={"input": [ids]})
    assert refused.status_code == 400 and "reward model" in refused.json()["error"]["message"]


@pytest.mark.slow
def test_schemathesis_on_token_classification(
    token_server: tuple[httpx.Client, ServerProcess, Any, Path], tmp_path: Path
) -> None:
    """The published schema of /pooling and /classify (its task enum: token_classify) against the
    token classifier: cases that follow it (inputs kept short) answer what it documents, never a 5xx."""
    http, srv, _, _ = token_server
    schema = http.get("/openapi.json").json()
    schema["paths"] = {path: schema["paths"][path] for path in ("/pooling", "/classify")}
    assert schema["components"]["schemas"]["PoolingRequest"]["properties"]["task"]["anyOf"][0]["enum"] == [
        "token_classify"
    ]

    def shorten(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                shorten(item)
        elif isinstance(node, dict):
            if node.get("type") == "string" and "enum" not in node:
                node["maxLength"] = min(node.get("maxLength", 40), 40)
            if node.get("type") == "array":
                node["maxItems"] = min(node.get("maxItems", 3), 3)
            for value in node.values():
                shorten(value)

    for name in ("PoolingRequest", "ClassificationRequest"):
        shorten(schema["components"]["schemas"][name])
    location = tmp_path / "tokens.json"
    location.write_text(json.dumps(schema))
    run_schemathesis(
        srv,
        str(location),
        tmp_path,
        *("--mode", "positive", "--max-examples", "10", "--phases", "examples,coverage,fuzzing", "--checks", CHECKS),
        timeout=150,
    )

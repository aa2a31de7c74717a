"""The pooling endpoints of a real `python -m sonar serve`: the embedded SmolLM2 served as an
embedding model (``--convert embed``: its last token's hidden state, normalized), through the
official `openai` SDK and httpx; and a generative server (the package's `plain_server`), which
answers them with 400.
"""

from __future__ import annotations

import base64
import copy
import json
import math
from pathlib import Path
from typing import Any, Iterator

import httpx
import numpy as np
import openai
import pytest

from tests.chaos.test_schema import CHECKS, run_schemathesis
from tests.http.conftest import ServerProcess, start_server, stop_server_cleanly

MODEL = "smol-embed"
MAX_MODEL_LEN = 64
TEXTS = ["The cat sat on the mat.", "A dog barked at the moon.", "Stock markets fell sharply today."]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start_server(
        tmp_path_factory.mktemp("pooling"),
        *("--convert", "embed", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN)),
        *("--num-gpu-blocks-override", "64", "--served-model-name", MODEL, "--disable-uvicorn-access-log"),
    )
    yield srv
    stop_server_cleanly(srv)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


def embed(http: httpx.Client, texts: Any, **fields: Any) -> list[list[float]]:
    r = http.post("/v1/embeddings", json={"input": texts, "encoding_format": "float", **fields})
    assert r.status_code == 200, r.text
    return [d["embedding"] for d in r.json()["data"]]


def cos(a: list[float], b: list[float]) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_embeddings_through_the_openai_sdk_float_and_base64(client: openai.OpenAI):
    floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert floats.model == MODEL and floats.object == "list"
    assert [d.index for d in floats.data] == [0, 1, 2]
    size = len(floats.data[0].embedding)
    assert size == 576  # SmolLM2-135M's hidden size
    for d in floats.data:
        assert len(d.embedding) == size
        assert math.isclose(float(np.linalg.norm(d.embedding)), 1.0, abs_tol=1e-4)  # normalized
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 0
    # The SDK asks for base64 when no format is given, and decodes it as float32.
    b64 = client.embeddings.create(model=MODEL, input=TEXTS)
    for f, b in zip(floats.data, b64.data):
        np.testing.assert_allclose(b.embedding, f.embedding, atol=1e-6)


def test_raw_base64_is_float32_little_endian(http: httpx.Client):
    r = http.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    vector = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vector, embed(http, TEXTS[0])[0], atol=1e-6)


def test_text_and_its_token_ids_embed_alike(http: httpx.Client):
    ids = http.post("/tokenize", json={"prompt": TEXTS[1]}).json()["tokens"]
    by_text, by_ids = embed(http, [TEXTS[1], TEXTS[2]])[0], embed(http, [ids])[0]
    np.testing.assert_allclose(by_ids, by_text, atol=1e-5)
    batch = embed(http, TEXTS)
    np.testing.assert_allclose(batch[1], by_text, atol=1e-4)  # batched or alone


def test_normalize_false_gives_the_raw_hidden_state(http: httpx.Client):
    raw = embed(http, TEXTS[0], normalize=False)[0]
    unit = embed(http, TEXTS[0])[0]
    assert np.linalg.norm(raw) > 1.5
    np.testing.assert_allclose(np.asarray(raw) / np.linalg.norm(raw), unit, atol=1e-5)


def test_dimensions_on_a_model_without_matryoshka_is_a_400(client: openai.OpenAI):
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=MODEL, input="x", dimensions=8)
    assert info.value.body["param"] == "dimensions"


def test_too_long_is_a_400_unless_truncated(client: openai.OpenAI, http: httpx.Client):
    long = "word " * 200
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=MODEL, input=long)
    assert info.value.code == "context_length_exceeded"
    kept = client.embeddings.create(model=MODEL, input=long, extra_body={"truncate_prompt_tokens": 10})
    assert kept.usage.prompt_tokens == 10
    whole = client.embeddings.create(model=MODEL, input=long, extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == MAX_MODEL_LEN


def test_refusals_name_the_field(http: httpx.Client):
    for body, param in [
        ({"input": []}, "input"),
        ({"input": "x", "temperature": 1}, "temperature"),
        ({"input": "x", "encoding_format": "binary"}, "encoding_format"),
        ({"input": "x", "user": "u"}, "user"),  # only recorded in the request log, which is off
        ({"input": [[10**9]]}, "input"),
    ]:
        r = http.post("/v1/embeddings", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_pooling_embed_and_token_embed(http: httpx.Client):
    r = http.post("/pooling", json={"input": TEXTS[0], "task": "embed"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["data"][0]["object"] == "pooling" and body["id"].startswith("pool-")
    np.testing.assert_allclose(body["data"][0]["data"], embed(http, TEXTS[0])[0], atol=1e-6)
    r = http.post("/pooling", json={"input": TEXTS[0], "task": "token_embed", "normalize": False})
    assert r.status_code == 200, r.text
    rows = r.json()["data"][0]["data"]  # one row per prompt token, the last one the embedding before normalizing
    assert len(rows) == r.json()["usage"]["prompt_tokens"] and len(rows[0]) == 576
    np.testing.assert_allclose(rows[-1], embed(http, TEXTS[0], normalize=False)[0], atol=1e-4)
    r = http.post("/pooling", json={"input": TEXTS[0], "task": "token_embed", "encoding_format": "base64"})
    flat = np.frombuffer(base64.b64decode(r.json()["data"][0]["data"]), dtype="<f4")
    assert flat.shape == (len(rows) * 576,)
    r = http.post("/classify", json={"input": TEXTS[0]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "task"


def test_score_and_rerank_by_cosine(http: httpx.Client):
    query = "Where did the cat sit?"
    vectors = embed(http, [query, *TEXTS])
    expected = [cos(vectors[0], v) for v in vectors[1:]]
    r = http.post("/score", json={"text_1": query, "text_2": TEXTS, "model": MODEL})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and body["data"][0]["object"] == "score"
    assert [d["score"] for d in body["data"]] == pytest.approx(expected, abs=1e-4)
    pairs = http.post("/v1/score", json={"queries": [query, TEXTS[0]], "documents": [TEXTS[0], TEXTS[0]]}).json()
    assert pairs["data"][0]["score"] == pytest.approx(expected[0], abs=1e-4)
    assert pairs["data"][1]["score"] == pytest.approx(1.0, abs=1e-4)
    bad = http.post("/score", json={"text_1": [query, query], "text_2": TEXTS})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_2"
    long = "word " * 200
    for body, param in [
        ({"text_1": query, "text_2": [TEXTS[0], long]}, "text_2"),
        ({"text_1": long, "text_2": TEXTS[0]}, "text_1"),
        ({"queries": long, "documents": TEXTS[0]}, "queries"),
    ]:
        r = http.post("/score", json=body)
        assert r.status_code == 400, r.text
        assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (param, "context_length_exceeded")
    cut = http.post("/score", json={"text_1": long, "text_2": TEXTS[0], "truncate_prompt_tokens": -1})
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] > MAX_MODEL_LEN
    order = sorted(range(3), key=lambda i: -expected[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = http.post(path, json={"query": query, "documents": TEXTS, "top_n": 2})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == order[:2]
        assert [x["document"]["text"] for x in results] == [TEXTS[i] for i in order[:2]]
        assert [x["relevance_score"] for x in results] == pytest.approx([expected[i] for i in order[:2]], abs=1e-4)


def test_a_generative_server_answers_400(plain_server: ServerProcess):
    client = openai.OpenAI(base_url=f"{plain_server.base_url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model="smol", input="x")
    assert "--runner pooling" in info.value.message
    for path, body in [("/score", {"text_1": "a", "text_2": "b"}), ("/rerank", {"query": "a", "documents": ["b"]})]:
        r = httpx.post(f"{plain_server.base_url}{path}", json=body, timeout=30)
        assert r.status_code == 400 and "--runner pooling" in r.json()["error"]["message"]


POOLING_PATHS = ("/v1/embeddings", "/pooling", "/classify", "/score", "/rerank", "/v2/rerank")


def test_schemathesis_on_the_pooling_routes(server: ServerProcess, http: httpx.Client, tmp_path: Path):
    """The published schema of the pooling routes against the server: cases that break it are
    refused with a documented 4xx; cases that follow it (strings and lists kept short) answer
    what it documents, never a 5xx."""
    schema = http.get("/openapi.json").json()
    schema["paths"] = {path: schema["paths"][path] for path in POOLING_PATHS}
    full = tmp_path / "pooling.json"
    full.write_text(json.dumps(schema))
    short = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item)
        elif isinstance(node, dict):
            if node.get("type") == "string" and "enum" not in node:
                node["maxLength"] = min(node.get("maxLength", 40), 40)
            if node.get("type") == "array":
                node["maxItems"] = min(node.get("maxItems", 3), 3)
            for value in node.values():
                walk(value)

    for name in ("EmbeddingRequest", "PoolingRequest", "ClassificationRequest", "ScoreRequest", "RerankRequest"):
        walk(short["components"]["schemas"][name])
    narrowed = tmp_path / "pooling-short.json"
    narrowed.write_text(json.dumps(short))
    for mode, location, checks in [
        ("negative", full, f"{CHECKS},negative_data_rejection"),
        ("positive", narrowed, CHECKS),
    ]:
        out = tmp_path / mode
        out.mkdir()
        run_schemathesis(
            server,
            str(location),
            out,
            *("--mode", mode, "--max-examples", "10", "--phases", "examples,coverage,fuzzing", "--checks", checks),
            timeout=150,
        )


def metric(http: httpx.Client, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def test_pooling_requests_are_counted_in_the_metrics(http: httpx.Client):
    before = metric(http, "sonar:request_success_total", finished_reason="stop")
    tokens = metric(http, "sonar:prompt_tokens_total")
    r = http.post("/v1/embeddings", json={"input": TEXTS[:2]})
    assert r.status_code == 200
    assert metric(http, "sonar:request_success_total", finished_reason="stop") == before + 2
    assert metric(http, "sonar:prompt_tokens_total") == tokens + r.json()["usage"]["prompt_tokens"]


# -- a cross-encoder (tests/models/tiny_pooling.py) -----------------------------------------------
QUERY = "what is the capital of france"
DOCUMENTS = ["paris is the capital of france", "the cat sat on the mat", "gravity is a force", "paris"]


@pytest.fixture(scope="module", params=["bert", "qwen3"])
def reranker(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, Path]]:
    """A tiny reranker with one label served with --runner pooling: a BertForSequenceClassification
    (the pair's second text has token type 1) or a Qwen3ForSequenceClassification (a decoder)."""
    from tests.models.tiny_pooling import save_tiny_bert, save_tiny_decoder_classifier

    path = tmp_path_factory.mktemp(f"reranker-{request.param}")
    if request.param == "bert":
        save_tiny_bert(path, "bert", num_labels=1, seed=3)
    else:
        save_tiny_decoder_classifier(path, "qwen3", num_labels=1, seed=3)
    srv = start_server(
        tmp_path_factory.mktemp("reranker"),
        *("--model", str(path), "--runner", "pooling", "--dtype", "float32", "--num-gpu-blocks-override", "64"),
        *("--served-model-name", "reranker", "--disable-uvicorn-access-log"),
    )
    yield srv, path
    stop_server_cleanly(srv)


def test_a_cross_encoder_scores_and_reranks_as_sentence_transformers(reranker: tuple[ServerProcess, Path]):
    from sentence_transformers import CrossEncoder

    srv, path = reranker
    expected = [float(s) for s in CrossEncoder(str(path), device="cpu").predict([(QUERY, d) for d in DOCUMENTS])]
    with httpx.Client(base_url=srv.base_url, timeout=60) as http:
        r = http.post("/score", json={"text_1": QUERY, "text_2": DOCUMENTS})
        assert r.status_code == 200, r.text
        assert [d["score"] for d in r.json()["data"]] == pytest.approx(expected, abs=1e-4)
        r = http.post("/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS, "return_documents": False})
        assert r.status_code == 200, r.text
        order = sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])
        results = r.json()["results"]
        assert [x["index"] for x in results] == order and all("document" not in x for x in results)
        assert [x["relevance_score"] for x in results] == pytest.approx([expected[i] for i in order], abs=1e-4)
        # /classify takes one text: one probability per label.
        r = http.post("/classify", json={"input": QUERY})
        assert r.status_code == 200 and r.json()["data"][0]["num_classes"] == 1
        r = http.post("/v1/embeddings", json={"input": QUERY})
        assert r.status_code == 400 and r.json()["error"]["param"] == "task"

"""The pooling endpoints' requests and responses without an engine: parsing, refusals naming the
field, base64, score pairing, rerank order; and the routes over a stand-in engine (`FakeLLM`) that
embeds a text as its character counts."""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import anyio
import msgspec
import numpy as np
import pytest
from starlette.testclient import TestClient

from sonar.errors import InvalidRequestError
from sonar.http.app import build_app
from sonar.http.pooling_protocol import (
    MAX_INPUTS,
    ClassificationRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
    check_pooling_params,
    classification,
    encode_data,
    parse_inputs,
    rerank_results,
)
from sonar.http.protocol import RequestError, decode_request
from sonar.http.settings import ServerSettings
from sonar.pooling_params import PooledData, PoolingInfo, PoolingParams


def pooled(values: Sequence[Any]) -> PooledData:
    """A vector (or rows) as the engine carries it: float32 little-endian bytes and the shape."""
    arr = np.asarray(values, dtype="<f4")
    return PooledData(arr.tobytes(), list(arr.shape))


# -- inputs ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value, expected",
    [("a", ["a"]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]), ([[1], [2, 3]], [[1], [2, 3]])],
)
def test_input_shapes(value: Any, expected: Any):
    assert EmbeddingRequest(input=value).inputs() == expected


@pytest.mark.parametrize("value", ["", [], [""], [[]], [1, "a"], [[1], []], [True], [[1.5]], [-1], [["a"]]])
def test_bad_inputs_are_400s_naming_input(value: Any):
    with pytest.raises(RequestError) as info:
        EmbeddingRequest(input=value).inputs()
    assert info.value.param == "input" and info.value.status == 400


def test_at_most_max_inputs():
    assert len(parse_inputs(["x"] * MAX_INPUTS, "input")) == MAX_INPUTS
    with pytest.raises(RequestError) as info:
        parse_inputs(["x"] * (MAX_INPUTS + 1), "input")
    assert info.value.param == "input" and f"at most {MAX_INPUTS}" in str(info.value)


# -- fields ---------------------------------------------------------------------------------------
def test_embedding_fields_map_to_pooling_params():
    req = decode_request(
        b'{"input": "x", "model": "m", "dimensions": 8, "normalize": false, "encoding_format": "base64",'
        b' "truncate_prompt_tokens": -1, "priority": 3}',
        EmbeddingRequest,
    )
    assert req.pooling_params() == PoolingParams(task="embed", dimensions=8, normalize=False)
    assert (req.encoding_format, req.truncate_prompt_tokens, req.priority) == ("base64", -1, 3)
    # vLLM's newer name for normalize on embeddings
    assert (
        decode_request(b'{"input": "x", "use_activation": false}', EmbeddingRequest).pooling_params().normalize is False
    )


@pytest.mark.parametrize(
    "body, param",
    [
        (b'{"input": "x", "encoding_format": "binary"}', "encoding_format"),
        (b'{"input": "x", "dimensions": 0}', "dimensions"),
        (b'{"input": "x", "truncate_prompt_tokens": -2}', "truncate_prompt_tokens"),
        (b'{"input": "x", "priority": 1e30}', "priority"),
        (b'{"input": "x", "normalize": true, "use_activation": false}', "use_activation"),
        (b'{"model": "m"}', "input"),
        (b'{"input": 5}', "input"),
    ],
)
def test_wrong_values_are_400s_naming_them(body: bytes, param: str):
    with pytest.raises(RequestError) as info:
        decode_request(body, EmbeddingRequest).pooling_params()
    assert info.value.param == param


def test_truncate_prompt_tokens_zero_is_refused():
    with pytest.raises(RequestError) as info:
        decode_request(b'{"input": "x", "truncate_prompt_tokens": 0}', EmbeddingRequest).inputs()
    assert info.value.param == "truncate_prompt_tokens"


@pytest.mark.parametrize("kind", [EmbeddingRequest, PoolingRequest, ClassificationRequest])
def test_unknown_fields_are_400s_naming_them(kind: type):
    with pytest.raises(RequestError) as info:
        decode_request(b'{"input": "x", "temperature": 1}', kind)
    assert info.value.param == "temperature" and "unknown field" in str(info.value)


@pytest.mark.parametrize(
    "kind, body, param",
    [
        (EmbeddingRequest, b'{"input": "x", "request_id": "r"}', "request_id"),
        (EmbeddingRequest, b'{"input": "x", "add_special_tokens": false}', "add_special_tokens"),
        (EmbeddingRequest, b'{"input": "x", "embed_dtype": "float16"}', "embed_dtype"),
        (EmbeddingRequest, b'{"input": "x", "endianness": "big"}', "endianness"),
        (PoolingRequest, b'{"input": "x", "messages": []}', "messages"),
        (ClassificationRequest, b'{"input": "x", "cache_salt": "s"}', "cache_salt"),
        (ScoreRequest, b'{"text_1": "x", "text_2": "y", "softmax": true}', "softmax"),
        (RerankRequest, b'{"query": "x", "documents": ["y"], "max_chunks_per_doc": 2}', "max_chunks_per_doc"),
    ],
)
def test_refused_fields_are_400s_naming_them(kind: type, body: bytes, param: str):
    with pytest.raises(RequestError) as info:
        decode_request(body, kind)
    assert info.value.param == param and str(info.value).startswith(f"{param} is not supported: ")


def test_refused_fields_pass_the_values_that_ask_for_what_sonar_does():
    req = decode_request(
        b'{"input": "x", "add_special_tokens": true, "embed_dtype": "float32", "endianness": "little",'
        b' "padding": "do_not_pad", "truncation_side": "right", "request_id": null}',
        EmbeddingRequest,
    )
    assert req.inputs() == ["x"]


def test_pooling_task_defaults_to_the_models_first():
    info = PoolingInfo(tasks=["classify", "token_classify"], pooling_type="cls", hidden_size=4, num_labels=2)
    assert decode_request(b'{"input": "x"}', PoolingRequest).pooling_params(info).task == "classify"
    req = decode_request(b'{"input": "x", "task": "token_classify"}', PoolingRequest)
    assert req.pooling_params(info).task == "token_classify"


def test_pooling_params_the_model_cannot_serve_are_400s_naming_them():
    info = PoolingInfo(tasks=["embed"], pooling_type="last", hidden_size=4)
    for params, param in [
        (PoolingParams(task="classify"), "task"),
        (PoolingParams(task="embed", dimensions=2), "dimensions"),
        (PoolingParams(task="bogus"), "task"),
    ]:
        with pytest.raises(RequestError) as info_:
            check_pooling_params(params, info)
        assert info_.value.param == param and info_.value.status == 400
    check_pooling_params(PoolingParams(task="embed", dimensions=4), info)


def test_classification_request():
    req = decode_request(b'{"input": ["a", "b"], "use_activation": false}', ClassificationRequest)
    assert req.pooling_params() == PoolingParams(task="classify", use_activation=False)
    assert req.inputs() == ["a", "b"]


# -- encoding and responses -----------------------------------------------------------------------
def test_base64_is_float32_little_endian_as_the_openai_sdk_decodes_it():
    values = [0.25, -1.5, 3.0e-8, 12345.678]
    text = encode_data(pooled(values), "base64")
    assert isinstance(text, str)
    decoded = np.frombuffer(base64.b64decode(text), dtype="<f4")
    np.testing.assert_array_equal(decoded, np.array(values, dtype=np.float32))
    assert encode_data(pooled(values), "float") == [float(np.float32(v)) for v in values]


def test_per_token_results_are_rows():
    rows = [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
    assert encode_data(pooled(rows), "float") == rows
    flat = np.frombuffer(base64.b64decode(encode_data(pooled(rows), "base64")), dtype="<f4")
    assert flat.reshape(3, 2).tolist() == rows


def test_classification_label_is_the_most_probable():
    assert msgspec.to_builtins(classification(2, [0.1, 0.7, 0.2], ["neg", "pos", "mid"])) == {
        "index": 2,
        "label": "pos",
        "probs": [0.1, 0.7, 0.2],
        "num_classes": 3,
    }
    assert classification(0, [0.1, 0.9], []).label == "1"


def test_rerank_results_best_first_top_n_and_documents():
    scores = [0.2, 0.9, 0.5, 0.9]
    docs = ["a", "b", "c", "d"]
    ranked = rerank_results(scores, docs, None, True)
    assert [r.index for r in ranked] == [1, 3, 2, 0]  # ties in their given order
    assert [r.document.text for r in ranked if r.document] == ["b", "d", "c", "a"]
    assert [r.index for r in rerank_results(scores, docs, 2, True)] == [1, 3]
    assert len(rerank_results(scores, docs, 0, True)) == 4
    bare = msgspec.to_builtins(rerank_results(scores, docs, 1, False))
    assert bare == [{"index": 1, "relevance_score": 0.9}]


# -- score pairing --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body, expected",
    [
        (b'{"text_1": "q", "text_2": "d"}', (["q"], ["d"])),
        (b'{"text_1": "q", "text_2": ["a", "b"]}', (["q"], ["a", "b"])),
        (b'{"text_1": ["q"], "text_2": ["a", "b"]}', (["q"], ["a", "b"])),
        (b'{"text_1": ["q", "r"], "text_2": ["a", "b"]}', (["q", "r"], ["a", "b"])),
        (b'{"queries": "q", "documents": ["a"]}', (["q"], ["a"])),
    ],
)
def test_score_pairs(body: bytes, expected: Any):
    assert decode_request(body, ScoreRequest).pairs() == expected


@pytest.mark.parametrize(
    "body, param",
    [
        (b'{"text_1": ["q", "r"], "text_2": ["a", "b", "c"]}', "text_2"),
        (b'{"text_1": ["q", "r"], "text_2": "a"}', "text_2"),
        (b'{"text_1": "q"}', "text_2"),
        (b'{"text_2": "q"}', "text_1"),
        (b'{"text_1": "q", "text_2": []}', "text_2"),
        (b'{"text_1": "", "text_2": "d"}', "text_1"),
        (b'{"text_1": "q", "text_2": "d", "documents": ["e"]}', "queries"),
        (b"{}", "text_1"),
    ],
)
def test_bad_score_pairs_are_400s_naming_the_field(body: bytes, param: str):
    with pytest.raises(RequestError) as info:
        decode_request(body, ScoreRequest).pairs()
    assert info.value.param == param


def test_rerank_documents_are_strings_or_objects_with_text():
    req = decode_request(b'{"query": "q", "documents": ["a", {"text": "b"}], "top_n": 1}', RerankRequest)
    assert req.texts() == ["a", "b"] and req.top_n == 1 and req.return_documents is True
    for body, param in [
        (b'{"query": "q", "documents": [{"content": "b"}]}', "documents"),
        (b'{"query": "q", "documents": []}', "documents"),
        (b'{"query": "", "documents": ["a"]}', "query"),
        (b'{"query": "q", "documents": ["a"], "top_n": -1}', "top_n"),
    ]:
        with pytest.raises(RequestError) as info:
            decode_request(body, RerankRequest).texts()
        assert info.value.param is not None and info.value.param.startswith(param), body


# -- the routes over a stand-in engine ------------------------------------------------------------
@dataclass
class Output:
    request_id: str
    prompt_token_ids: list[int]
    data: PooledData


@dataclass
class Info:
    pooling: PoolingInfo | None
    max_model_len: int = 16
    vocab_size: int = 1000


@dataclass
class FakeLLM:
    """Embeds a text by its counts of the letters a, b, c (a token per character); classifies by
    its length. Records each call."""

    pooling: PoolingInfo | None
    calls: list[Any] = field(default_factory=list)
    tokenizer: Any = None

    def __post_init__(self) -> None:
        self.info = Info(self.pooling)

    def has_model(self, name: str) -> bool:
        return False

    def check_prompt_chars(self, text: str, param: str = "prompt") -> None:
        if len(text) > 100:
            raise InvalidRequestError("too many characters", param=param)

    def check_token_ids(self, ids: Sequence[int], param: str = "prompt") -> None:
        if any(t >= self.info.vocab_size for t in ids):
            raise InvalidRequestError("outside the vocabulary", param=param)

    async def encode(self, prompt: Any, params: PoolingParams | None = None, **kwargs: Any) -> Output:
        self.calls.append((prompt, params, kwargs))
        await anyio.sleep(0)
        ids = [ord(c) for c in prompt] if isinstance(prompt, str) else list(prompt)
        truncate = kwargs.get("truncate_prompt_tokens")
        if truncate is not None:
            ids = ids[: self.info.max_model_len if truncate < 0 else truncate]
        if len(ids) > self.info.max_model_len:
            raise InvalidRequestError("too long", param="input", code="context_length_exceeded")
        text = "".join(chr(i) for i in ids)
        assert params is not None
        if params.task == "classify":
            n = len(ids)
            values: list[float] = (
                [1 / (1 + math.exp(-(n - 5)))] if self.pooling.num_labels == 1 else [n / 20, 1 - n / 20]
            )
        else:
            values = [float(text.count(c)) for c in "abc"]
        return Output(kwargs.get("request_id") or "r", ids, pooled(values))


def client_for(llm: FakeLLM, **settings: Any) -> TestClient:
    return TestClient(build_app(llm, ServerSettings(served_model_names=("m",), **settings)))  # type: ignore[arg-type]


EMBED = PoolingInfo(tasks=["embed", "token_embed"], pooling_type="last", hidden_size=3)
CROSS = PoolingInfo(tasks=["classify"], pooling_type="cls", hidden_size=3, num_labels=1)


def test_embeddings_route():
    llm = FakeLLM(EMBED)
    r = client_for(llm).post("/v1/embeddings", json={"input": [[97, 97, 98], [97, 99]], "model": "m"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "m" and body["id"].startswith("embd-")
    assert [d["embedding"] for d in body["data"]] == [[2.0, 1.0, 0.0], [1.0, 0.0, 1.0]]
    assert [(d["object"], d["index"]) for d in body["data"]] == [("embedding", 0), ("embedding", 1)]
    assert body["usage"] == {"prompt_tokens": 5, "total_tokens": 5}
    assert isinstance(body["created"], int)
    b64 = client_for(llm).post("/v1/embeddings", json={"input": "abc", "encoding_format": "base64"}).json()
    assert np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4").tolist() == [1.0, 1.0, 1.0]


def test_engine_errors_keep_their_param_and_code():
    llm = FakeLLM(EMBED)
    r = client_for(llm).post("/v1/embeddings", json={"input": "a" * 17})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "input" and r.json()["error"]["code"] == "context_length_exceeded"
    ok = client_for(llm).post("/v1/embeddings", json={"input": "a" * 17, "truncate_prompt_tokens": 4})
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 4


def test_inputs_are_checked_before_any_runs():
    llm = FakeLLM(EMBED)
    r = client_for(llm).post("/v1/embeddings", json={"input": [[1, 2], [5000]]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    r = client_for(llm).post("/v1/embeddings", json={"input": "abc", "dimensions": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"
    assert llm.calls == []


def test_user_is_refused_without_the_request_log_and_taken_with_it():
    r = client_for(FakeLLM(EMBED)).post("/v1/embeddings", json={"input": "a", "user": "u"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "user"
    ok = client_for(FakeLLM(EMBED), enable_log_requests=True).post("/v1/embeddings", json={"input": "a", "user": "u"})
    assert ok.status_code == 200


def test_unknown_model_is_a_404():
    r = client_for(FakeLLM(EMBED)).post("/v1/embeddings", json={"input": "a", "model": "other"})
    assert r.status_code == 404


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/embeddings", {"input": "a"}),
        ("/pooling", {"input": "a"}),
        ("/classify", {"input": "a"}),
        ("/score", {"text_1": "a", "text_2": "b"}),
        ("/v1/score", {"text_1": "a", "text_2": "b"}),
        ("/rerank", {"query": "a", "documents": ["b"]}),
        ("/v1/rerank", {"query": "a", "documents": ["b"]}),
        ("/v2/rerank", {"query": "a", "documents": ["b"]}),
    ],
)
def test_a_generative_model_answers_400_on_every_pooling_route(path: str, body: dict[str, Any]):
    r = client_for(FakeLLM(None)).post(path, json=body)
    assert r.status_code == 400
    assert "--runner pooling" in r.json()["error"]["message"] and r.json()["error"]["type"] == "BadRequestError"


def test_pooling_route_token_task_gives_rows():
    llm = FakeLLM(EMBED)
    r = client_for(llm).post("/pooling", json={"input": "ab", "task": "embed"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("pool-") and body["data"] == [
        {"index": 0, "object": "pooling", "data": [1.0, 1.0, 0.0]}
    ]
    r = client_for(llm).post("/pooling", json={"input": "ab", "task": "classify"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "task"


def test_classify_route():
    info = PoolingInfo(tasks=["classify"], pooling_type="cls", hidden_size=3, num_labels=2, labels=["short", "long"])
    r = client_for(FakeLLM(info)).post("/classify", json={"input": ["ab", "abcdefghijklmnop"]})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["label"] for d in data] == ["long", "short"] and data[0]["num_classes"] == 2
    assert r.json()["id"].startswith("classify-")


def test_score_and_rerank_with_an_embedding_model_use_cosine():
    llm = FakeLLM(EMBED)
    client = client_for(llm)
    r = client.post("/score", json={"text_1": "aa", "text_2": ["ab", "cc", "aaa"]})
    assert r.status_code == 200, r.text
    scores = [d["score"] for d in r.json()["data"]]
    assert scores == pytest.approx([1 / math.sqrt(2), 0.0, 1.0])
    assert r.json()["usage"]["prompt_tokens"] == 2 + 2 + 2 + 3  # the query embedded once
    assert len(llm.calls) == 4
    r = client.post("/rerank", json={"query": "aa", "documents": ["ab", {"text": "cc"}, "aaa"], "top_n": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("rerank-") and body["model"] == "m"
    assert [(x["index"], x["document"]["text"]) for x in body["results"]] == [(2, "aaa"), (0, "ab")]
    r = client.post("/score", json={"text_1": "aa", "text_2": "ab", "use_activation": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "use_activation"


def test_score_with_a_cross_encoder_tokenizes_pairs():
    class Tokenizer:
        def __call__(self, text: str, text_pair: str, truncation: bool, max_length: int | None = None) -> dict:
            ids = [1, *map(ord, text), 2, *map(ord, text_pair), 2]
            types = [0] * (len(text) + 2) + [1] * (len(text_pair) + 1)
            if truncation and max_length is not None:
                ids, types = ids[:max_length], types[:max_length]
            return {"input_ids": ids, "token_type_ids": types}

    llm = FakeLLM(CROSS, tokenizer=Tokenizer())
    r = client_for(llm).post("/score", json={"queries": ["q", "qq"], "documents": ["d", "dd"]})
    assert r.status_code == 200, r.text
    assert [c[1].pair_start for c in llm.calls] == [3, 4]
    assert [d["score"] for d in r.json()["data"]] == pytest.approx([1 / (1 + math.exp(0)), 1 / (1 + math.exp(-2))])
    r = client_for(llm).post("/score", json={"queries": "q" * 20, "documents": "d"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents"
    r = client_for(llm).post("/score", json={"queries": "q" * 20, "documents": "d", "truncate_prompt_tokens": -1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 16
    r = client_for(llm).post("/score", json={"queries": "q", "documents": "d", "truncate_prompt_tokens": 17})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_openapi_declares_the_pooling_routes_for_a_pooling_model_only():
    from sonar.http.openapi import Limits, build_openapi

    generative = build_openapi(Limits(max_model_len=16, max_logprobs=5, vocab_size=100))
    assert "/v1/embeddings" not in generative["paths"]
    doc = build_openapi(
        Limits(max_model_len=16, max_logprobs=5, vocab_size=100, served_model_names=("m",), pooling_tasks=("embed",))
    )
    for path in (
        "/v1/embeddings",
        "/pooling",
        "/classify",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
    ):
        assert {"200", "400", "404"} <= set(doc["paths"][path]["post"]["responses"]), path
    assert "/v1/completions" in generative["paths"] and "/v1/completions" not in doc["paths"]
    assert "/v1/chat/completions" not in doc["paths"] and "/tokenize" in doc["paths"]
    schemas = doc["components"]["schemas"]
    embedding = schemas["EmbeddingRequest"]["properties"]
    assert embedding["input"]["anyOf"][2]["items"]["maximum"] == 99
    assert embedding["request_id"]["description"].startswith("Refused: request_id is not supported")
    assert embedding["model"]["anyOf"][0]["enum"] == ["m"]
    assert schemas["PoolingRequest"]["properties"]["task"]["anyOf"][0] == {"enum": ["embed"]}
    assert schemas["EmbeddingRequest"]["additionalProperties"] is False
    msgspec.json.encode(doc)

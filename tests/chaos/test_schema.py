"""Schemathesis against a real `python -m sonar serve` and the OpenAPI schema it publishes.

Two runs of the `st` CLI (a subprocess: the run is isolated from pytest's own plugins):

* **negative**: cases that break the published schema (wrong types, values out of range, missing
  required fields, ...). The server must refuse every one with a documented 4xx: checks
  `negative_data_rejection`, `not_a_server_error`, status code, content type and response schema.
* **positive**: cases that follow the schema, with generation narrowed for a CPU (`max_tokens` at
  most 4, `n` at most 2, short strings and lists; the narrowed copy is written to a file, the
  requests still go to the real server). No 5xx, and every answer, a 200 or a 4xx (a semantic
  limit a schema cannot state), must match its documented schema and content type.

Bounded in time: a fixed number of examples per operation, a timeout per request.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tests.http.conftest import ServerProcess, start_server, stop_server

MODEL = "smol"
MAX_MODEL_LEN = 64
MAX_LOGPROBS = 5
ST = Path(sys.executable).with_name("st")
CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start_server(
        tmp_path_factory.mktemp("schema"),
        "--dtype",
        "float32",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--kv-cache-memory-bytes",
        "64M",
        "--seed",
        "0",
        "--served-model-name",
        MODEL,
        "--max-logprobs",
        str(MAX_LOGPROBS),
        "--disable-uvicorn-access-log",
    )
    yield srv
    code = stop_server(srv)
    assert code == 0, f"the server exited with {code} on SIGTERM:\n{srv.log()[-4000:]}"
    assert "request.failed" not in srv.log(), srv.log()[-6000:]


@pytest.fixture(scope="module")
def schema(server: ServerProcess) -> dict[str, Any]:
    r = httpx.get(f"{server.base_url}/openapi.json", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    return r.json()


def test_openapi_document(schema: dict[str, Any]) -> None:
    assert schema["openapi"].startswith("3.1")
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        responses = schema["paths"][path]["post"]["responses"]
        assert {"200", "400", "404"} <= set(responses)
        assert responses["400"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorResponse"
        }
    schemas = schema["components"]["schemas"]
    assert set(schemas["ErrorInfo"]["required"]) == {"message", "type", "param", "code"}
    completion = schemas["CompletionRequest"]["properties"]
    # The engine's limits are stated: the model length, --max-logprobs, the vocabulary.
    # (0 scores the prompt: only with echo, which a schema cannot tie to it.)
    assert {"type": "integer", "minimum": 0, "maximum": MAX_MODEL_LEN} in completion["max_tokens"]["anyOf"]
    assert {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS} in completion["logprobs"]["anyOf"]
    # prompt or prompt_embeds (--enable-prompt-embeds): neither is required alone; a request with
    # neither is a 400 naming prompt (tests/http/test_serving_extras.py)
    assert {"prompt", "prompt_embeds"} <= set(completion) and "prompt" not in schemas["CompletionRequest"].get(
        "required", []
    )
    # Nothing is accepted silently: unknown fields are refused, refused fields say why.
    for name in ("CompletionRequest", "ChatCompletionRequest", "ChatMessage", "TextPart", "ResponseFormat"):
        assert schemas[name]["additionalProperties"] is False, name
    store = schemas["ChatCompletionRequest"]["properties"]["store"]
    assert store["anyOf"] == [{"type": "null"}, {"const": False}] and "store is not supported" in store["description"]
    assert "404" in schema["paths"]["/v1/models/{model}"]["get"]["responses"]


def narrowed(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy whose requests stay cheap on a CPU: few tokens, few completions, short inputs."""
    doc = copy.deepcopy(schema)
    caps = {
        "max_tokens": 4,
        "max_completion_tokens": 4,
        "min_tokens": 4,
        "n": 2,
        "best_of": 2,
        "logprobs": 2,
        "top_logprobs": 2,
        "max_output_tokens": 4,
    }

    def walk(node: Any, name: str | None = None) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item, name)
            return
        if not isinstance(node, dict):
            return
        if node.get("type") == "integer" and name in caps:
            node["maximum"] = min(node.get("maximum", caps[name]), caps[name])
        if node.get("type") == "string" and "enum" not in node:
            node["maxLength"] = min(node.get("maxLength", 40), 40)
        if node.get("type") == "array":
            node["maxItems"] = min(node.get("maxItems", 3), 3)
        if node.get("type") == "object" and name == "logit_bias":
            node["maxProperties"] = 2
        for key, value in node.items():
            if key == "properties":
                for prop, sub in value.items():
                    walk(sub, prop)
            elif key in ("anyOf", "oneOf", "items", "additionalProperties"):
                walk(value, name)

    # Only what the client sends: the answers are checked against the published schemas as they are.
    for name in (
        "CompletionRequest",
        "ChatCompletionRequest",
        "TokenizeRequest",
        "DetokenizeRequest",
        "ChatMessage",
        "TextPart",
        "StreamOptions",
        "ResponsesRequest",
    ):
        walk(doc["components"]["schemas"][name])
    # Generation with max_tokens left out (null) would run to the model length: make it explicit.
    for request in ("CompletionRequest", "ChatCompletionRequest"):
        component = doc["components"]["schemas"][request]
        component["properties"]["max_tokens"] = {"type": "integer", "minimum": 1, "maximum": 4}
        component["properties"].pop("max_completion_tokens", None)
        component["required"] = sorted(set(component.get("required", [])) | {"max_tokens"})
    responses = doc["components"]["schemas"]["ResponsesRequest"]
    responses["properties"]["max_output_tokens"] = {"type": "integer", "minimum": 1, "maximum": 4}
    responses["required"] = sorted(set(responses.get("required", [])) | {"max_output_tokens"})
    return doc


#: What refuses a request that breaks the schema: schemathesis's own list, and 413 (a body over
#: --max-request-body-bytes, e.g. a batch of prompts each just over --max-prompt-chars).
REJECTIONS = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429"]


def run_schemathesis(server: ServerProcess, location: str, tmp: Path, *args: str, timeout: float) -> None:
    env = dict(os.environ, SCHEMATHESIS_TELEMETRY="false", NO_COLOR="1")
    # Read from the working directory.
    (tmp / "schemathesis.toml").write_text(
        f"[checks.negative_data_rejection]\nexpected-statuses = {json.dumps(REJECTIONS)}\n"
    )
    cmd = [
        str(ST),
        "run",
        location,
        "--url",
        server.base_url,
        "--seed",
        "0",
        "--request-timeout",
        "30",
        "--suppress-health-check",
        "all",
        "--no-shrink",
        "--warnings",
        "off",
        # One worker: two threads generating cases trip CPython 3.11's AST recursion counter, which
        # they share ("SystemError: AST constructor recursion depth mismatch", CPython gh-106905),
        # and generation is CPU-bound under the GIL: two were no faster.
        "--workers",
        "1",
        "--report",
        "junit",
        "--report-dir",
        str(tmp),
        *args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{output[-12000:]}\n--- server log ---\n{server.log()[-4000:]}"
    assert "passed" in output.lower() or "tested" in output.lower(), output[-4000:]


def test_negative_cases_are_rejected(server: ServerProcess, schema: dict[str, Any], tmp_path: Path) -> None:
    run_schemathesis(
        server,
        f"{server.base_url}/openapi.json",
        tmp_path,
        "--mode",
        "negative",
        "--max-examples",
        "20",
        "--phases",
        "examples,coverage,fuzzing",
        "--checks",
        f"{CHECKS},negative_data_rejection",
        timeout=150,
    )


def test_positive_cases_conform(server: ServerProcess, schema: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "openapi-narrowed.json"
    path.write_text(json.dumps(narrowed(schema)))
    run_schemathesis(
        server,
        str(path),
        tmp_path,
        "--mode",
        "positive",
        "--max-examples",
        "10",
        "--phases",
        "examples,coverage,fuzzing",
        "--checks",
        CHECKS,
        timeout=150,
    )
    assert (
        httpx.post(
            f"{server.base_url}/v1/completions",
            json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0},
            timeout=30,
        ).status_code
        == 200
    )

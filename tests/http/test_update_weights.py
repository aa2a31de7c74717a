"""``POST /update_weights`` on a real server (`sonar/http/admin.py`, ``--weight-transfer-config``):
a server started on checkpoint A answers with checkpoint B's greedy tokens (transformers' on B)
after an update from B's folder, and with A's again after A's tensors arrive as a safetensors
body; a checkpoint of other shapes gets 400 and changes nothing; the route needs the API key.
The worker runs in a process of its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from safetensors.torch import load_file, save

from tests.engine.test_weights import save_llama
from tests.http.conftest import ServerProcess, serving
from tests.models.against import transformers_greedy

KEY = "trainer-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT_IDS = [5, 17, 300, 9]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    out = {}
    for name, seed, inter in (("a", 1, 128), ("b", 2, 128), ("wide", 3, 192)):
        path = tmp_path_factory.mktemp(f"llama-{name}")
        out[name] = (path, save_llama(path, seed, inter))
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, checkpoints: dict) -> Iterator[ServerProcess]:
    args = (
        *(str(checkpoints["a"][0]), "--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "256"),
        *("--num-gpu-blocks-override", "64", "--placement", "worker=process", "--api-key", KEY),
        *("--weight-transfer-config", '{"backend": "sonar"}'),
    )
    with serving(tmp_path_factory.mktemp("weights"), *args) as srv:
        yield srv


def greedy_words(http: httpx.Client) -> list[str]:
    body = {"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": 8, "temperature": 0}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"].split()


def words_of(hf: Any) -> list[str]:
    return [f"w{t}" for t in transformers_greedy(hf, PROMPT_IDS, 8)[0]]


def test_update_weights_from_a_folder_and_from_a_safetensors_body(server: ServerProcess, checkpoints: dict) -> None:
    (path_a, hf_a), (path_b, hf_b), (path_wide, _) = checkpoints["a"], checkpoints["b"], checkpoints["wide"]
    assert httpx.post(server.base_url + "/update_weights", json={"path": str(path_b)}, timeout=30).status_code == 401
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as http:
        assert greedy_words(http) == words_of(hf_a)

        response = http.post("/update_weights", json={"path": str(path_b)})
        assert response.status_code == 200, response.text
        assert response.json()["tensors"] == len(load_file(str(path_b / "model.safetensors")))
        assert greedy_words(http) == words_of(hf_b)

        refused = http.post("/update_weights", json={"path": str(path_wide)})
        assert refused.status_code == 400 and "has shape" in refused.json()["error"]["message"], refused.text
        assert http.post("/update_weights", json={"folder": "x"}).status_code == 400
        garbage = http.post(
            "/update_weights", content=b"not safetensors", headers={"Content-Type": "application/octet-stream"}
        )
        assert garbage.status_code == 400 and "safetensors" in garbage.json()["error"]["message"], garbage.text
        assert greedy_words(http) == words_of(hf_b)

        body = save(load_file(str(path_a / "model.safetensors")))
        response = http.post("/update_weights", content=body, headers={"Content-Type": "application/octet-stream"})
        assert response.status_code == 200, response.text
        assert greedy_words(http) == words_of(hf_a)


def test_the_openapi_document_declares_update_weights() -> None:
    from sonar.http.openapi import Limits, build_openapi

    assert "/update_weights" not in build_openapi(Limits(16, 5, 100))["paths"]
    doc = build_openapi(Limits(16, 5, 100, api_key=True, weight_updates=True))["paths"]
    assert {"400", "401", "409"} <= set(doc["/update_weights"]["post"]["responses"])
    assert "application/octet-stream" in doc["/update_weights"]["post"]["requestBody"]["content"]

"""The serving extras over a real `python -m sonar serve` on HTTPS: --middleware (a class and a
function from a module on PYTHONPATH), --enable-ssl-refresh (the certificate replaced while it
serves), --chat-template-content-format auto with a template that loops over content parts,
--logits-processors with per-request vllm_xargs, and --enable-prompt-embeds (torch-saved tensors
in base64; that embeddings give the token prompt's output is shown in tests/engine/test_prompt_embeds.py);
plus the start-up refusals of each."""

from __future__ import annotations

import base64
import io
import os
import ssl
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import torch

from tests.http.conftest import ROOT, ServerProcess, free_port, stop_server_cleanly
from tests.http.test_content_format import PARTS_TEMPLATE
from tests.http.test_tls import install, make_cert

BASE = ("--dtype", "float32", "--max-model-len", "256", "--num-gpu-blocks-override", "64", "--seed", "0")

MIDDLEWARE = """
from starlette.middleware.base import BaseHTTPMiddleware


class Stamp(BaseHTTPMiddleware):
    async def dispatch(self, request, call_next):
        response = await call_next(request)
        response.headers["x-stamp"] = "class"
        return response


async def stamp(request, call_next):
    response = await call_next(request)
    response.headers["x-stamp-fn"] = request.url.path
    return response
"""

PROCESSOR = '''
class ForceToken:
    """Forces `target_token` (vllm_xargs) on the requests that ask for it."""

    def __init__(self, config, device, is_pin_memory):
        self.targets = {}

    def is_argmax_invariant(self):
        return False

    def update_state(self, update):
        if update is None:
            return
        for row, params, _, _ in update.added:
            target = (params.extra_args or {}).get("target_token")
            if target is None:
                self.targets.pop(row, None)
            else:
                self.targets[row] = target
        for row in update.removed:
            self.targets.pop(row, None)

    def apply(self, logits):
        if self.targets and -1 in self.targets.values():
            raise RuntimeError("asked to fail")
        for row, target in self.targets.items():
            logits[row] = float("-inf")
            logits[row, target] = 0.0
        return logits

    @classmethod
    def validate_params(cls, params):
        target = (params.extra_args or {}).get("target_token")
        if target is not None and (not isinstance(target, int) or target < -1):
            raise ValueError(f"target_token must be a token id, got {target!r}")
'''


def run_serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sonar", "serve", *args],
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )


def start_https(tmp: Path, cafile: Path, *args: str, env: dict[str, str], timeout: float = 120.0) -> ServerProcess:
    """`start_server` for HTTPS: /health answers 200 to a client that trusts `cafile`."""
    port = free_port()
    out, err = tmp / "server.out", tmp / "server.err"
    environ = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **env}
    with out.open("wb") as fout, err.open("wb") as ferr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sonar", "serve", "--host", "127.0.0.1", "--port", str(port), *args],
            cwd=ROOT, env=environ, stdout=fout, stderr=ferr,
        )  # fmt: skip
    server = ServerProcess(proc, f"https://127.0.0.1:{port}", out, err)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the server exited with {proc.returncode}:\n{server.out()}\n{server.log()[-4000:]}")
        try:
            if httpx.get(f"{server.base_url}/health", verify=trusting(cafile), timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    stop_server_cleanly(server)
    pytest.fail(f"the server did not become healthy in {timeout} s:\n{server.log()[-4000:]}")


def trusting(cafile: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(cafile))


class Extras:
    def __init__(self, server: ServerProcess, certs: dict[str, tuple[Path, Path]], live: tuple[Path, Path]) -> None:
        self.server, self.certs, self.live = server, certs, live
        self.cafile = certs["alpha"][0]

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{self.server.base_url}{path}", json=body, verify=trusting(self.cafile), timeout=120)


@pytest.fixture(scope="module")
def extras(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Extras]:
    tmp = tmp_path_factory.mktemp("extras")
    (tmp / "site").mkdir()
    (tmp / "site" / "extras_middleware.py").write_text(MIDDLEWARE)
    (tmp / "site" / "extras_processors.py").write_text(PROCESSOR)
    (tmp / "parts.jinja").write_text(PARTS_TEMPLATE)
    certs = {name: make_cert(tmp, name) for name in ("alpha", "beta")}
    live = (tmp / "server.crt", tmp / "server.key")
    install(certs["alpha"], live)
    server = start_https(
        tmp, certs["alpha"][0], *BASE,
        "--ssl-certfile", str(live[0]), "--ssl-keyfile", str(live[1]), "--enable-ssl-refresh",
        "--middleware", "extras_middleware:Stamp", "--middleware", "extras_middleware.stamp",
        "--chat-template", str(tmp / "parts.jinja"),
        "--logits-processors", "extras_processors.ForceToken",
        "--enable-prompt-embeds",
        env={"PYTHONPATH": str(tmp / "site")},
    )  # fmt: skip
    yield Extras(server, certs, live)
    stop_server_cleanly(server)


def test_middleware_wraps_every_route(extras: Extras) -> None:
    r = httpx.get(f"{extras.server.base_url}/health", verify=trusting(extras.cafile))
    assert r.status_code == 200 and r.headers["x-stamp"] == "class" and r.headers["x-stamp-fn"] == "/health"
    r = extras.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200 and r.headers["x-stamp"] == "class" and r.headers["x-stamp-fn"] == "/v1/completions"
    r = extras.post("/v1/nowhere", {})
    assert r.status_code == 404 and r.headers["x-stamp"] == "class"


def test_content_parts_reach_a_template_that_loops_over_them(extras: Extras) -> None:
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    rendered = extras.post(
        "/tokenize", {"messages": [{"role": "user", "content": parts}], "add_generation_prompt": False}
    )
    assert rendered.status_code == 200, rendered.text
    expected = extras.post("/tokenize", {"prompt": "<|im_start|>user\n[text:Hello][text:world]<|im_end|>\n"})
    assert rendered.json()["tokens"] == expected.json()["tokens"]
    chat = extras.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert chat.status_code == 200, chat.text
    response = extras.post("/v1/responses", {"input": "Hi", "max_output_tokens": 2})  # its text turns to parts
    assert response.status_code == 200, response.text


def test_logits_processor_forces_the_requested_token_only(extras: Extras) -> None:
    target = extras.post("/tokenize", {"prompt": " lighthouse"}).json()["tokens"][0]
    prompt = "The capital of France is"
    plain = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    alone = extras.post("/v1/completions", plain).json()["choices"][0]["text"]
    forced = {**plain, "vllm_xargs": {"target_token": target}}
    with ThreadPoolExecutor(4) as pool:  # in one batch: each row keeps its own arguments
        answers = list(pool.map(lambda body: extras.post("/v1/completions", body), [forced, plain, forced, plain]))
    texts = [a.json()["choices"][0]["text"] for a in answers]
    assert texts[0] == texts[2] == " lighthouse" * 6
    assert texts[1] == texts[3] == alone != texts[0]


def test_processor_arguments_are_validated(extras: Extras) -> None:
    r = extras.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "vllm_xargs": {"target_token": "x"}})
    assert r.status_code == 400 and "target_token must be a token id" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "vllm_xargs"


def test_a_failing_processor_fails_its_step_and_the_server_serves_on(extras: Extras) -> None:
    r = extras.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "vllm_xargs": {"target_token": -1}})
    assert r.status_code >= 400 and "a logits processor failed: RuntimeError: asked to fail" in r.text
    r = extras.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_a_renewed_certificate_serves_new_connections(extras: Extras) -> None:
    url = f"{extras.server.base_url}/health"
    old, new = extras.certs["alpha"][0], extras.certs["beta"][0]
    held = httpx.Client(verify=trusting(old))
    assert held.get(url).status_code == 200  # an open connection from before the renewal
    install(extras.certs["beta"], extras.live)
    deadline = time.monotonic() + 15
    while True:
        try:
            if httpx.get(url, verify=trusting(new), timeout=2).status_code == 200:
                break
        except httpx.ConnectError:
            assert time.monotonic() < deadline, "the server did not pick up the new certificate"
            time.sleep(0.2)
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(url, verify=trusting(old), timeout=5)
    assert held.get(url).status_code == 200  # still on the old handshake
    held.close()
    install(extras.certs["alpha"], extras.live)  # back, for the module's other tests
    deadline = time.monotonic() + 15
    while True:
        try:
            httpx.get(url, verify=trusting(old), timeout=2)
            break
        except httpx.ConnectError:
            assert time.monotonic() < deadline
            time.sleep(0.2)


def test_start_up_refusals(tmp_path: Path) -> None:
    r = run_serve("--middleware", "nosuch_module_xyz:Thing")
    assert r.returncode == 2 and "--middleware 'nosuch_module_xyz:Thing': cannot import" in r.stderr
    r = run_serve("--logits-processors", "nosuch_module_xyz.Proc")
    assert r.returncode == 2 and "--logits-processors 'nosuch_module_xyz.Proc'" in r.stderr
    r = run_serve("--enable-ssl-refresh")
    assert r.returncode == 2 and "needs --ssl-keyfile and --ssl-certfile" in r.stderr
    r = run_serve("--enable-prompt-embeds", "--tensor-parallel-size", "2")
    assert r.returncode == 2 and "--enable-prompt-embeds with tensor or pipeline parallelism" in r.stderr


def test_without_the_flags_their_fields_are_a_400(plain_server: ServerProcess) -> None:
    url = f"{plain_server.base_url}/v1/completions"
    r = httpx.post(url, json={"prompt": "Hi", "max_tokens": 2, "vllm_xargs": {"target_token": 5}}, timeout=60)
    assert r.status_code == 400 and "--logits-processors" in r.json()["error"]["message"]
    r = httpx.post(url, json={"prompt_embeds": embeds(torch.zeros(3, HIDDEN)), "max_tokens": 2}, timeout=60)
    assert r.status_code == 400 and "--enable-prompt-embeds" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "prompt_embeds"


#: SmolLM2-135M's hidden size: the width of its input embeddings.
HIDDEN = 576


def embeds(tensor: Any) -> str:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def test_prompt_embeds_run_and_bad_ones_are_a_400(extras: Extras) -> None:
    torch.manual_seed(0)
    body = {"prompt_embeds": [embeds(torch.randn(5, HIDDEN) * 0.05), embeds(torch.randn(1, 7, HIDDEN) * 0.05)],
            "max_tokens": 3, "temperature": 0, "ignore_eos": True}  # fmt: skip
    r = extras.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2 and r.json()["usage"]["prompt_tokens"] == 12
    assert r.json()["usage"]["completion_tokens"] == 6
    one = embeds(torch.zeros(2, HIDDEN))
    for extra, param, says in [
        ({"prompt_embeds": embeds(torch.zeros(2, HIDDEN + 1))}, "prompt_embeds", f"[tokens, {HIDDEN}]"),
        ({"prompt_embeds": "%%%"}, "prompt_embeds", "base64"),
        ({"prompt_embeds": embeds({"not": "a tensor"})}, "prompt_embeds", "must be a tensor"),
        ({"prompt_embeds": embeds(torch.zeros(300, HIDDEN))}, "prompt_embeds", "rows"),
        ({"prompt_embeds": one, "prompt": "Hi"}, "prompt_embeds", "not both"),
        ({"prompt_embeds": one, "echo": True}, "echo", "echo"),
        ({"prompt_embeds": []}, "prompt_embeds", "must not be empty"),
    ]:
        r = extras.post("/v1/completions", {"max_tokens": 2, **extra})
        assert r.status_code == 400, (extra.keys(), r.text)
        assert r.json()["error"]["param"] == param and says in r.json()["error"]["message"]
    r = extras.post("/v1/completions", {"max_tokens": 2})
    assert r.status_code == 400 and "prompt is required" in r.json()["error"]["message"]

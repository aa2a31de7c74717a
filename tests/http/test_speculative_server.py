"""`sonar serve` with speculative decoding: the flags take effect, the text is the plain server's,
and /metrics counts drafts (`sonar:spec_decode_*`)."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.http.conftest import PLAIN_SERVER_ARGS, ServerProcess, serving
from tests.http.test_metrics import scrape, value

PROMPT = (
    "Repeat this list exactly: apples, pears, plums, cherries, apples, pears, plums, cherries, "
    "apples, pears, plums, cherries.\nList: apples, pears,"
)


def complete(server: ServerProcess) -> dict:
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        r = http.post("/v1/completions", json={"model": "smol", "prompt": PROMPT, "max_tokens": 24, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()


def test_spec_flags_speculate_and_the_text_is_unchanged(plain_server: ServerProcess, tmp_path: Path) -> None:
    expected = complete(plain_server)["choices"][0]["text"]
    args = (*PLAIN_SERVER_ARGS, "--spec-method", "ngram", "--spec-tokens", "3", "-sc.prompt_lookup_min", "2")
    with serving(tmp_path, *args) as server:
        body = complete(server)
        assert body["choices"][0]["text"] == expected
        assert body["usage"]["completion_tokens"] == 24
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            samples = scrape(http)
        drafts = value(samples, "sonar:spec_decode_num_draft_tokens_total")
        accepted = value(samples, "sonar:spec_decode_num_accepted_tokens_total")
        assert drafts >= accepted > 0
        assert value(samples, "sonar:spec_decode_num_drafts_total") > 0
        per_position = [
            value(samples, "sonar:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(3)
        ]
        assert sum(per_position) == accepted and per_position[0] >= per_position[1] >= per_position[2]

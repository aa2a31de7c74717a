"""The metrics API server processes share (`--api-server-count` > 1; `sonar.http.metrics`), without
a server: two real processes record requests in one directory as API servers do, then exit with
requests still in flight (as a killed server would). A scrape sums what both counted, from either
process's registry or a reader's; `/load` sums their in-flight counts until the owner marks a
process dead (`forget_dead`), which drops its count and keeps its counters."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sonar.cli.api_servers import forget_dead
from sonar.http.metrics import MULTIPROC_ENV, SharedCollector

ROOT = Path(__file__).resolve().parents[2]

# An API server's part: `requests` finished requests (5 prompt tokens, 1 s each), `requests`
# more in flight when it ends; its pid, then its own scrape, on stdout.
RECORD = """
import os, sys
from prometheus_client import generate_latest
from sonar.http.metrics import ServerMetrics
m = ServerMetrics()
assert m.shared is not None, "the instruments do not write to the shared directory"
requests = int(sys.argv[1])
for _ in range(requests):
    m.request_success.labels(finished_reason="stop").inc()
    m.prompt_tokens.inc(5)
    m.e2e.observe(1.0)
m.add_load(requests)
print(os.getpid())
sys.stdout.write(generate_latest(m.registry).decode())
"""


def record(shared: Path, requests: int) -> subprocess.Popen[str]:
    env = {**os.environ, MULTIPROC_ENV: str(shared)}
    return subprocess.Popen(
        [sys.executable, "-c", RECORD, str(requests)], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
    )


def values(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_a_scrape_sums_every_process_and_a_dead_ones_load_is_dropped(tmp_path: Path) -> None:
    shared = tmp_path / "metrics"
    shared.mkdir(mode=0o700)
    first = record(shared, 2)
    out, _ = first.communicate(timeout=120)
    assert first.returncode == 0
    first_pid = int(out.splitlines()[0])
    second = record(shared, 3)  # after the first: its own scrape then holds both
    out, _ = second.communicate(timeout=120)
    assert second.returncode == 0
    second_pid, own_scrape = int(out.splitlines()[0]), out.split("\n", 1)[1]

    reader = SharedCollector(str(shared))
    registry = CollectorRegistry()
    registry.register(reader)
    for text in (own_scrape, generate_latest(registry).decode()):
        m = values(text)
        assert m[("sonar:request_success_total", (("finished_reason", "stop"),))] == 5
        assert m[("sonar:prompt_tokens_total", ())] == 25
        assert m[("sonar:e2e_request_latency_seconds_count", ())] == 5
        assert m[("sonar:e2e_request_latency_seconds_sum", ())] == 5.0
        assert m[("sonar:e2e_request_latency_seconds_bucket", (("le", "1.0"),))] == 5
        assert not any(name.startswith("sonar:server_load") for name, _ in m)  # /load only
        types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
        assert len(types) == len(set(types))  # each process's values once
    assert reader.total("sonar:prompt_tokens") == 25
    assert reader.load() == 5

    assert forget_dead({first_pid, second_pid}, {second_pid}, str(shared)) == {second_pid}
    assert reader.load() == 3
    assert values(generate_latest(registry).decode())[("sonar:prompt_tokens_total", ())] == 25

"""`python -m sonar bench compare`: Sonar against a peer over a small grid, real servers both."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sonar.__main__ import main
from sonar.bench.compare import build_parser, grid_cells, server_specs, warm_up_cell
from sonar.bench.peers import Load, kv_bytes_per_token, kv_gib, pause, resume
from tests.bench.conftest import SERVER_ARGS, assert_png, env_of_subprocess

OUTPUT_LEN = 4


def _small_grid(out: Path, rounds: int) -> list[str]:
    """`bench compare` of Sonar against a second Sonar (its worker in the API process, paused
    while Sonar runs) on a small grid: concurrency 1 and 4, 16-token prompts and a 24+8 shared
    prefix, 4 requests of 4 tokens out per cell."""
    sonar_args = shlex.join(SERVER_ARGS)
    peer = f"{shlex.quote(sys.executable)} -m sonar serve --port {{port}} --placement worker=inprocess {sonar_args}"
    return [
        "bench",
        "compare",
        "--out",
        str(out),
        "--sonar-args",
        sonar_args,
        "--peer",
        f"inproc={peer}",
        "--pause-idle",
        "inproc",
        "--concurrency",
        "1,4",
        "--input-len",
        "16",
        "--output-len",
        str(OUTPUT_LEN),
        "--prefix-len",
        "24",
        "--suffix-len",
        "8",
        "--rounds",
        str(rounds),
        "--min-prompts",
        "4",
        "--prompts-per-slot",
        "1",
    ]


def test_sonar_against_a_peer(tmp_path: Path) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(_small_grid(tmp_path, rounds=1))
    report = out.getvalue()
    assert code == 0, report
    result = json.loads((tmp_path / "compare.json").read_text())
    assert [s["name"] for s in result["servers"]] == ["sonar", "inproc"]
    assert result["runs_done"] == result["runs_planned"] == 8 and not result["partial"]
    for server in result["servers"]:
        assert server["ready_s"] > 0
        # the model's weights and the KV cache at least: a whole process tree was measured
        assert server["peak_pss_bytes"] > 300 << 20, server
    assert result["floor"]["bandwidth_gbs"] > 0.5 and result["floor"]["weight_bytes"] > 200e6
    cells = {(c["workload"], c["concurrency"]): c for c in result["cells"]}
    assert set(cells) == {("random", 1), ("random", 4), ("shared-prefix", 1), ("shared-prefix", 4)}
    for cell in cells.values():
        for name in ("sonar", "inproc"):
            (run,) = cell["runs"][name]
            assert run["completed"] == cell["num_prompts"] == 4 and run["failed"] == 0
            assert run["total_output_tokens"] == 4 * OUTPUT_LEN
    # The load goals are judged on the ratio to the peer; concurrency 1 also on the floor.
    load = {c["name"]: c for c in cells[("random", 4)]["checks"]}
    runs = cells[("random", 4)]["runs"]
    expected = runs["sonar"][0]["output_throughput"] / runs["inproc"][0]["output_throughput"]
    assert load["tok/s"]["ratio"] == pytest.approx(expected)
    assert {c["name"] for c in cells[("random", 1)]["checks"]} == {"TPOT/floor", "TTFT"}
    # The shared prefix was served from the cache after its first request.
    assert cells[("shared-prefix", 4)]["runs"]["sonar"][0]["prefix_cache_hit_rate"] > 0
    md = (tmp_path / "compare.md").read_text()
    assert "## random" in md and "## shared-prefix" in md and "| 4 | 24+8 |" in md and "Goals met:" in md
    assert md in report and "partial" not in md
    for workload in ("random", "shared-prefix"):
        assert_png(tmp_path / f"compare-{workload}.png")


def test_sigterm_stops_the_servers_and_keeps_the_runs(tmp_path: Path) -> None:
    """Stopped after its first run, the comparison stops both servers (the peer while paused too)
    and leaves the runs it measured, marked partial, and exits as killed by SIGTERM."""
    log = tmp_path / "compare.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sonar", *_small_grid(tmp_path, rounds=3)],
            env=env_of_subprocess(),
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    result: dict = {}
    try:
        deadline = time.monotonic() + 120
        while not result.get("runs_done"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
            if (tmp_path / "compare.json").exists():  # written atomically: never half a file
                result = json.loads((tmp_path / "compare.json").read_text())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for server in result.get("servers", []):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server["pid"], signal.SIGKILL)
    result = json.loads((tmp_path / "compare.json").read_text())
    assert result["partial"] and result["stopped_by"] == "SIGTERM"
    runs = [run for cell in result["cells"] for runs in cell.get("runs", {}).values() for run in runs]
    assert 1 <= result["runs_done"] == len(runs) < result["runs_planned"] == 24
    assert all(run["failed"] == 0 for run in runs)
    md = (tmp_path / "compare.md").read_text()
    assert f"partial: {len(runs)} of 24 runs, stopped by SIGTERM" in md and "## random" in md
    assert [s["name"] for s in result["servers"]] == ["sonar", "inproc"]
    for server in result["servers"]:  # each leads a process group: the server and its children
        deadline = time.monotonic() + 5
        while _group(server["pid"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _group(server["pid"]) == [], f"{server['name']} is still running"
    assert not list(tmp_path.glob(".compare.*")), "a temporary file was left behind"


def test_a_paused_server_and_its_children_stop_and_resume() -> None:
    """Pausing stops the whole process group (a server and, e.g., its engine process)."""
    code = "import subprocess, time; subprocess.Popen(['sleep', '30']); time.sleep(30)"
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while len(_group(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        group = _group(proc.pid)
        assert len(group) == 2
        pause(proc.pid)
        assert _wait_for_state(group, "T") == {"T"}
        resume(proc.pid)
        assert _wait_for_state(group, "S") == {"S"}
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _group(pgid: int) -> list[int]:
    """The live processes of the group `pgid` (a zombie has exited; only its parent has yet to
    reap it, which for an orphan in a container may be never)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def _wait_for_state(pids: list[int], state: str) -> set[str]:
    """The processes' states once all are `state`, or as they are after 5 s (a signal is
    delivered asynchronously)."""
    deadline = time.monotonic() + 5
    while True:
        states = {Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] for p in pids}
        if states == {state} or time.monotonic() > deadline:
            return states
        time.sleep(0.02)


def _args(*argv: str):
    return build_parser().parse_args(["--out", "unused", *argv])


def test_the_grid_and_its_prompt_counts() -> None:
    args = _args("--concurrency", "1,16", "--input-len", "128,1024", "--prefix-len", "512", "--suffix-len", "64")
    cells = grid_cells(args)
    assert [(c["workload"], c["concurrency"], c["input_len"]) for c in cells] == [
        ("random", 1, 128),
        ("random", 16, 128),
        ("random", 1, 1024),
        ("random", 16, 1024),
        ("shared-prefix", 1, 576),
        ("shared-prefix", 16, 576),
    ]
    assert [c["num_prompts"] for c in cells] == [8, 32, 8, 32, 8, 32]
    assert not any(c["workload"] == "shared-prefix" for c in grid_cells(_args("--prefix-len", "0")))


def test_the_warm_up_is_no_bigger_than_the_grid() -> None:
    big = grid_cells(_args("--concurrency", "1,16", "--input-len", "128,1024", "--output-len", "128"))
    assert warm_up_cell(big, 16) == {
        "workload": "random",
        "concurrency": 4,
        "input_len": 64,
        "output_len": 16,
        "num_prompts": 8,
    }
    small = grid_cells(
        _args(
            *("--concurrency", "1,4", "--input-len", "16,32", "--output-len", "4"),
            *("--prefix-len", "0", "--min-prompts", "4", "--prompts-per-slot", "1"),
        )
    )
    warm = warm_up_cell(small, 4)
    assert (warm["input_len"], warm["output_len"], warm["num_prompts"]) == (32, 4, 4)
    assert warm_up_cell(small, 2)["concurrency"] == 2


def test_every_server_gets_room_for_the_largest_load(tmp_path: Path) -> None:
    """llama.cpp gets a slot per concurrent request, each holding the longest prompt and its
    output; Sonar and vLLM the same tokens as GiB of KV cache, from the model's config."""
    (tmp_path / "config.json").write_text(
        json.dumps({"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576})
    )
    per_token = kv_bytes_per_token(tmp_path)
    assert per_token == 2 * 30 * 3 * 64 * 2
    # DeepSeek's latent attention: one 512 + 64 latent per token, held as K and V by Sonar
    mla = tmp_path / "mla"
    mla.mkdir()
    (mla / "config.json").write_text(
        json.dumps({"num_hidden_layers": 61, "num_attention_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64})
    )
    assert kv_bytes_per_token(mla) == 2 * 61 * 576 * 2
    load = Load(64, 4096, 128)
    gib = kv_gib(load, per_token)
    assert gib * (1 << 30) >= load.tokens * per_token
    args = _args(
        "--model-dir",
        str(tmp_path),
        "--llama-server",
        "/opt/llama-server",
        "--gguf",
        "/m.gguf",
        "--vllm-venv",
        "/venv",
        "--concurrency",
        "1,64",
        "--input-len",
        "128,4096",
    )
    sonar, llama, vllm = server_specs(args, load)
    assert f"--kv-cache-memory-bytes {gib}G" in sonar.command and "--dtype bfloat16" in sonar.command
    assert not sonar.pause_when_idle and llama.pause_when_idle and vllm.pause_when_idle
    llama_argv = shlex.split(llama.command)
    assert llama_argv[llama_argv.index("-np") + 1] == "64"
    assert int(llama_argv[llama_argv.index("-c") + 1]) >= 64 * (4096 + 128)
    assert vllm.env == {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(gib)}
    assert "{port}" in llama.command and "{port}" in vllm.command


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--llama-server", "/bin/llama-server"], "--gguf"),
        (["--vllm-venv", "/venv"], "--model-dir"),
        (["--peer", "sonar=x --port {port}"], "must differ"),
        (["--peer", "p=server-without-a-port"], "{port}"),
        (["--peer", "no-command"], "NAME=COMMAND"),
    ],
)
def test_an_impossible_comparison_is_refused(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "compare", "--out", "unused", *argv]) == 2
    assert message in capsys.readouterr().err

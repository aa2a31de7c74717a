"""The servers `bench compare` measures: Sonar and its peers, how each is started on the same
weights with room for the same load, and how an idle one is kept from taking CPU.

Each server gets KV cache room for the grid's largest load (every request of the highest
concurrency at the longest prompt plus its output), so that no server is measured preempting or
queueing for lack of memory another was given. An idle peer that polls (vLLM's engine loop) is
paused with SIGSTOP to its process group while another server is measured; Sonar's idle
processes sleep and are never paused (its supervisor would count a pause as a hang).
"""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

#: Requests beyond `max_concurrency * (input + output)` tokens a server's cache is sized for:
#: chat templates and tokenizer round trips make prompts a few tokens longer than asked.
TOKEN_SLACK = 64


@dataclass
class ServerSpec:
    """One server of a comparison: its name, the command that starts it (``{port}`` is replaced
    by the port), extra environment, and whether it is paused while another server runs."""

    name: str
    command: str
    env: dict[str, str] = field(default_factory=dict)
    pause_when_idle: bool = False


@dataclass(frozen=True)
class Load:
    """The largest load of a grid: what every server's KV cache must hold at once."""

    max_concurrency: int
    max_input_len: int
    output_len: int

    @property
    def tokens(self) -> int:
        return self.max_concurrency * (self.max_input_len + self.output_len + TOKEN_SLACK)

    @property
    def tokens_per_sequence(self) -> int:
        return self.max_input_len + self.output_len + TOKEN_SLACK


def kv_bytes_per_token(model_dir: Path, dtype_bytes: int = 2) -> int | None:
    """Bytes of K and V one token takes across all layers, from the model's config.json."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    layers = config.get("num_hidden_layers")
    if config.get("kv_lora_rank"):
        # Multi-head latent attention: one latent head per token, which Sonar's cache holds as
        # both K and V (see sonar/models/deepseek.py), so this is Sonar's size and a bound for peers.
        latent = config["kv_lora_rank"] + config.get("qk_rope_head_dim", 0)
        return 2 * layers * latent * dtype_bytes if layers else None
    heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or (config.get("hidden_size", 0) // heads if heads else None)
    if not (layers and kv_heads and head_dim):
        return None
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def kv_gib(load: Load, per_token: int) -> int:
    """Whole GiB of KV cache that hold `load` (with a tenth to spare for block rounding)."""
    return max(1, math.ceil(load.tokens * per_token * 1.1 / (1 << 30)))


def _command(argv: list[str]) -> str:
    """`argv` as one shell-quoted command line, its ``{port}`` placeholder left bare."""
    return shlex.join(argv).replace("'{port}'", "{port}")


def sonar_spec(model: str | None, extra_args: list[str], cache_gib: int | None, name: str = "sonar") -> ServerSpec:
    """Sonar's own server: `model` (None: the embedded model) in bf16 unless `extra_args` say."""
    argv = [sys.executable, "-m", "sonar", "serve"]
    if model:
        argv.append(model)
    argv += ["--host", "127.0.0.1", "--port", "{port}", "--disable-uvicorn-access-log"]
    if model and "--dtype" not in extra_args:
        argv += ["--dtype", "bfloat16"]
    if cache_gib and "--kv-cache-memory-bytes" not in extra_args:
        argv += ["--kv-cache-memory-bytes", f"{cache_gib}G"]
    return ServerSpec(name, _command(argv + extra_args))


def llama_spec(binary: str, gguf: str, load: Load, threads: int | None = None) -> ServerSpec:
    """llama.cpp's `llama-server` with one slot per concurrent request; its context (`-c`) is split
    among the slots, so each slot holds the longest prompt and its output."""
    argv = [
        binary,
        "-m",
        gguf,
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
        "-np",
        str(load.max_concurrency),
        "-c",
        str(load.tokens),
        "-t",
        str(threads or os.cpu_count() or 1),
    ]
    return ServerSpec("llama.cpp", _command(argv), pause_when_idle=True)


def vllm_spec(venv: str, model: str, cache_gib: int | None) -> ServerSpec:
    """vLLM's CPU build from the virtual environment `../shared/peers/vllm_cpu.sh` makes."""
    argv = [str(Path(venv) / "bin" / "vllm"), "serve", model, "--host", "127.0.0.1", "--port", "{port}"]
    argv += ["--dtype", "bfloat16"]
    env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(cache_gib or 4)}
    return ServerSpec("vllm", _command(argv), env, pause_when_idle=True)


def parse_peer(text: str, pause_when_idle: bool = False) -> ServerSpec:
    """``NAME=COMMAND`` (``{port}`` in COMMAND is replaced by the port) -> a peer."""
    name, sep, command = text.partition("=")
    name, command = name.strip(), command.strip()
    if not sep or not name or not command:
        raise ValueError(f"--peer takes NAME=COMMAND, not {text!r}")
    if "{port}" not in command:
        raise ValueError(f"--peer {name}: the command must contain {{port}} (where the server listens)")
    return ServerSpec(name, command, pause_when_idle=pause_when_idle)


def pause(pid: int) -> None:
    """Stop every process of the group `pid` leads (the server was started in its own session)."""
    os.killpg(pid, signal.SIGSTOP)


def resume(pid: int) -> None:
    os.killpg(pid, signal.SIGCONT)

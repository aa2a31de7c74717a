#!/usr/bin/env bash
# Sonar against vLLM's CPU build on the same weights, same dtype, same client (`vllm bench serve`),
# all servers up at once and the runs alternated, so the machine's noise hits both alike. While
# Sonar is measured, vLLM is paused (SIGSTOP to its process group): its idle engine polls and
# would otherwise take CPU from Sonar. Sonar's idle servers sleep, and are not paused: their
# liveness pings would count a pause as a hang. The client sends the same seed-0 prompts every run;
# vLLM's CPU build reports no prefix-cache hits on them, so Sonar runs with its prefix cache off
# too (every run is a cold-prompt comparison).
#   usage: scripts/compare_vllm.sh VLLM_VENV MODEL_DIR OUT_DIR [ROUNDS]
# VLLM_VENV comes from ../shared/peers/vllm_cpu.sh; MODEL_DIR is an HF folder both servers load
# (e.g. the embedded SmolLM2 converted to safetensors). Results: OUT_DIR/<server>-c<conc>-<round>.json
set -euo pipefail
venv=${1:?usage: compare_vllm.sh VLLM_VENV MODEL_DIR OUT_DIR [ROUNDS]}
model=${2:?model dir}
out=${3:?out dir}
rounds=${4:-2}
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
vport=8100
sport=8200
iport=8300

VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=2 setsid "$venv/bin/vllm" serve "$model" --port $vport --dtype bfloat16 \
    >"$out/vllm-server.log" 2>&1 &
vpid=$!
setsid "$root/.venv/bin/python" -m sonar serve "$model" --port $sport --dtype bfloat16 --disable-uvicorn-access-log \
    --no-enable-prefix-caching >"$out/sonar-server.log" 2>&1 &
spid=$!
# the same, with the worker in the server's own process (serve's default puts it in a child process)
setsid "$root/.venv/bin/python" -m sonar serve "$model" --port $iport --dtype bfloat16 --disable-uvicorn-access-log \
    --placement worker=inprocess --no-enable-prefix-caching >"$out/sonar-inproc-server.log" 2>&1 &
ipid=$!
trap 'for p in $vpid $spid $ipid; do kill -CONT -- -$p 2>/dev/null; kill -- -$p 2>/dev/null; done; wait 2>/dev/null || true' EXIT

wait_ready() {  # port pid name
    local t0=$SECONDS
    until curl -sf "http://127.0.0.1:$1/health" >/dev/null; do
        kill -0 "$2" 2>/dev/null || { echo "$3 exited during start-up"; exit 1; }
        sleep 1
    done
    echo "$3 ready after $((SECONDS - t0)) s (counted from this script's wait)"
}
wait_ready $sport $spid sonar
wait_ready $iport $ipid sonar-inproc
wait_ready $vport $vpid vllm

bench() {  # name port concurrency prompts round
    [ "$1" = vllm ] || kill -STOP -- "-$vpid"
    VLLM_TARGET_DEVICE=cpu "$venv/bin/vllm" bench serve --backend openai --base-url "http://127.0.0.1:$2" \
        --model "$model" --dataset-name random --random-input-len 128 --random-output-len 128 --seed 0 \
        --num-prompts "$4" --max-concurrency "$3" --ignore-eos --save-result --result-dir "$out" \
        --result-filename "$1-c$3-$5.json" >"$out/$1-c$3-$5.txt" 2>&1
    kill -CONT -- "-$vpid"
    grep -E "Output token throughput|Mean TTFT|Mean TPOT" "$out/$1-c$3-$5.txt" | sed "s/^/$1 c$3 r$5: /"
}
for r in $(seq 1 "$rounds"); do
    bench vllm $vport 16 64 "$r"
    bench sonar $sport 16 64 "$r"
    bench sonar-inproc $iport 16 64 "$r"
    bench sonar $sport 1 8 "$r"
    bench sonar-inproc $iport 1 8 "$r"
    bench vllm $vport 1 8 "$r"
done

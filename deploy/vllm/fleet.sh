#!/usr/bin/env bash
#! Starts and stops a fleet of real vLLM (CPU) engines on loopback for radixgate.
#!
#!   deploy/vllm/fleet.sh start STATE_DIR K BASE_PORT [tiny|small]
#!   deploy/vllm/fleet.sh stop STATE_DIR
#!
#! `start` installs vLLM and builds the model if needed (install.sh, make_model.py),
#! launches K API servers on 127.0.0.1:BASE_PORT.. with prefix caching, prompt-token
#! details and KV events (each engine publishes to tcp://127.0.0.1:(BASE_PORT+100+i),
#! which the subscriber binds), and waits until every /health answers 200. Engine i is
#! pinned to core i mod nproc. PIDs, logs and scratch caches live in STATE_DIR;
#! `stop` sends SIGTERM to each PID (vLLM stops its engine processes with it), waits,
#! then SIGKILLs what is left and removes the files vLLM leaves in /tmp.
#! Prints one line per engine: `ID ADDR KV_EVENTS_ENDPOINT`.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache="${RADIXGATE_CACHE:-$HOME/.cache/radixgate}"

stop() {
    local dir="$1"
    [[ -d "$dir" ]] || return 0
    local pids=()
    for f in "$dir"/engine-*.pid; do
        [[ -f "$f" ]] && pids+=("$(cat "$f")")
    done
    for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    for _ in $(seq 1 60); do
        local alive=0
        for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
        [[ $alive == 0 ]] && break
        sleep 0.5
    done
    for p in "${pids[@]}"; do
        # The API server's children (engine core) go with it on SIGTERM; on a hang,
        # kill the whole process group the server leads.
        kill -KILL -- "-$p" 2>/dev/null || kill -KILL "$p" 2>/dev/null || true
    done
    rm -f "$dir"/engine-*.pid
    rm -rf /tmp/vllm_dist_* 2>/dev/null || true
}

start() {
    local dir="$1" k="$2" base="$3" size="${4:-tiny}"
    mkdir -p "$dir"
    local py
    py="$("$here/install.sh" | tail -n1)"
    local model="$cache/models/$size"
    HF_HUB_OFFLINE=1 "$py" "$here/make_model.py" "$model" "$size" >/dev/null 2>&1 \
        || { echo "make_model.py failed" >&2; exit 1; }
    local ncpu
    ncpu="$(nproc)"
    for i in $(seq 0 $((k - 1))); do
        local port=$((base + i)) events=$((base + 100 + i))
        local scratch="$dir/scratch-$i"
        mkdir -p "$scratch"
        local kv="{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://127.0.0.1:$events\",\"topic\":\"kv\"}"
        # setsid: the server leads its own process group, so `stop` can reap it whole.
        HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" \
        VLLM_CPU_OMP_THREADS_BIND="$((i % ncpu))" \
        VLLM_CACHE_ROOT="$scratch/vllm" TORCHINDUCTOR_CACHE_DIR="$scratch/inductor" \
        setsid "$py" -m vllm.entrypoints.openai.api_server --model "$model" \
            --served-model-name "$size" --host 127.0.0.1 --port "$port" \
            --enable-prefix-caching --enable-prompt-tokens-details --max-model-len 4096 \
            --enforce-eager --kv-events-config "$kv" \
            >"$dir/engine-$i.log" 2>&1 &
        echo $! >"$dir/engine-$i.pid"
    done
    local deadline=$((SECONDS + ${RADIXGATE_VLLM_START_TIMEOUT:-900}))
    for i in $(seq 0 $((k - 1))); do
        local port=$((base + i))
        until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
            if ! kill -0 "$(cat "$dir/engine-$i.pid")" 2>/dev/null; then
                echo "engine $i exited; log tail:" >&2; tail -n 30 "$dir/engine-$i.log" >&2
                stop "$dir"; exit 1
            fi
            if ((SECONDS > deadline)); then
                echo "engine $i not ready in time; log tail:" >&2; tail -n 30 "$dir/engine-$i.log" >&2
                stop "$dir"; exit 1
            fi
            sleep 1
        done
    done
    for i in $(seq 0 $((k - 1))); do
        echo "vllm-$i 127.0.0.1:$((base + i)) tcp://127.0.0.1:$((base + 100 + i))"
    done
}

case "${1:-}" in
    start) shift; start "$@" ;;
    stop) shift; stop "$@" ;;
    *) sed -n 's/^#! \{0,1\}//p' "$0" >&2; exit 2 ;;
esac

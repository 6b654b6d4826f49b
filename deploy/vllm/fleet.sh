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
# shellcheck source=lib.sh
source "$here/lib.sh"

start() {
    local dir="$1" k="$2" base="$3" size="${4:-tiny}"
    mkdir -p "$dir"
    prepare_model "$size"
    local ncpu
    ncpu="$(nproc)"
    for i in $(seq 0 $((k - 1))); do
        local events=$((base + 100 + i))
        local kv="{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://127.0.0.1:$events\",\"topic\":\"kv\"}"
        launch_engine "$dir" "engine-$i" $((base + i)) $((i % ncpu)) "$size" --kv-events-config "$kv"
    done
    local deadline=$((SECONDS + ${RADIXGATE_VLLM_START_TIMEOUT:-900}))
    for i in $(seq 0 $((k - 1))); do
        wait_healthy "$dir" "engine-$i" $((base + i)) "$deadline"
    done
    for i in $(seq 0 $((k - 1))); do
        echo "vllm-$i 127.0.0.1:$((base + i)) tcp://127.0.0.1:$((base + 100 + i))"
    done
}

case "${1:-}" in
    start) shift; start "$@" ;;
    stop) shift; stop_engines "$@" ;;
    *) sed -n 's/^#! \{0,1\}//p' "$0" >&2; exit 2 ;;
esac

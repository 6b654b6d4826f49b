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
#!
#! RADIXGATE_VLLM_KV_MODE picks who binds the KV-event socket:
#!   connect (default)  the engine connects to tcp://127.0.0.1:(BASE_PORT+100+i) and
#!                      one gateway binds it (`kv_events = "..."`).
#!   bind               for cluster mode (many replicas): the engine binds
#!                      ipc://STATE_DIR/kv-i.sock (vLLM binds ipc:// endpoints; a
#!                      local socket file, no network port) and a replay ROUTER on
#!                      tcp://127.0.0.1:(BASE_PORT+200+i); every gateway connects
#!                      (`kv_events_connect`, `kv_events_replay`). Lines then read
#!                      `ID ADDR KV_EVENTS_ENDPOINT REPLAY_ENDPOINT`. Across hosts
#!                      vLLM binds only `tcp://*:PORT` (every interface): firewall
#!                      that port to the gateways' hosts.
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
    local mode="${RADIXGATE_VLLM_KV_MODE:-connect}"
    case "$mode" in
        connect | bind) ;;
        *) echo "RADIXGATE_VLLM_KV_MODE: expected connect or bind, got $mode" >&2; exit 2 ;;
    esac
    dir="$(cd "$dir" && pwd)"
    local lines=()
    for i in $(seq 0 $((k - 1))); do
        local endpoint extra="" line
        if [ "$mode" = bind ]; then
            endpoint="ipc://$dir/kv-$i.sock"
            local replay="tcp://127.0.0.1:$((base + 200 + i))"
            extra=",\"replay_endpoint\":\"$replay\""
            line="vllm-$i 127.0.0.1:$((base + i)) $endpoint $replay"
        else
            endpoint="tcp://127.0.0.1:$((base + 100 + i))"
            line="vllm-$i 127.0.0.1:$((base + i)) $endpoint"
        fi
        local kv="{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"$endpoint\"$extra,\"topic\":\"kv\"}"
        launch_engine "$dir" "engine-$i" $((base + i)) $((i % ncpu)) "$size" --kv-events-config "$kv"
        lines+=("$line")
    done
    local deadline=$((SECONDS + ${RADIXGATE_VLLM_START_TIMEOUT:-900}))
    for i in $(seq 0 $((k - 1))); do
        wait_healthy "$dir" "engine-$i" $((base + i)) "$deadline"
    done
    printf '%s\n' "${lines[@]}"
}

case "${1:-}" in
    start) shift; start "$@" ;;
    stop) shift; stop_engines "$@" ;;
    *) sed -n 's/^#! \{0,1\}//p' "$0" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
#! Starts and stops a fleet of real vLLM (CPU) engines on loopback for radixgate.
#!
#!   deploy/vllm/fleet.sh start STATE_DIR K BASE_PORT [tiny|small] [-- ENGINE_ARGS...]
#!   deploy/vllm/fleet.sh stop STATE_DIR
#!
#! `start` installs vLLM and builds the model if needed (install.sh, make_model.py),
#! launches K API servers on 127.0.0.1:BASE_PORT.. with prefix caching, prompt-token
#! details and KV events (each engine publishes to tcp://127.0.0.1:(BASE_PORT+100+i),
#! which the subscriber binds), and waits until every /health answers 200. Engine i is
#! pinned to core i mod nproc. PIDs, logs and scratch caches live in STATE_DIR;
#! ENGINE_ARGS after `--` go to every engine (e.g. `--num-gpu-blocks-override 100`).
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
#!
#! A heterogeneous fleet (engines of unequal speed):
#!   RADIXGATE_VLLM_CORES="0 0 1"   engine i is pinned to the i-th entry (a core or a
#!                                  range like 0-1, as VLLM_CPU_OMP_THREADS_BIND takes);
#!                                  engines sharing a core are slower.
#!   RADIXGATE_VLLM_ENGINE_ARGS_<i> more arguments for engine i alone, word-split
#!                                  (e.g. RADIXGATE_VLLM_ENGINE_ARGS_0="--max-num-seqs 1").
#!
#! RADIXGATE_VLLM_INPROC=1 runs each engine in one process (vLLM's
#! VLLM_ENABLE_V1_MULTIPROCESSING=0), pinned whole to its core with taskset; 0 runs
#! vLLM's default, a model worker process beside the engine. The default is 1 when two
#! engines share a core, else 0: the worker busy-polls for a second after each step,
#! and a neighbour on its core then waits up to that second (docs/real-vllm.md, "Where
#! the slow requests come from"; deploy/vllm/colocation-probe.sh measures both).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=lib.sh
source "$here/lib.sh"

start() {
    local dir="$1" k="$2" base="$3" size="tiny"
    shift 3
    if [[ $# -gt 0 && "$1" != "--" ]]; then
        size="$1"
        shift
    fi
    [[ "${1:-}" == "--" ]] && shift
    local common=("$@")
    mkdir -p "$dir"
    prepare_model "$size"
    local ncpu cores=()
    ncpu="$(nproc)"
    read -r -a cores <<<"${RADIXGATE_VLLM_CORES:-}"
    local mode="${RADIXGATE_VLLM_KV_MODE:-connect}"
    case "$mode" in
        connect | bind) ;;
        *) echo "RADIXGATE_VLLM_KV_MODE: expected connect or bind, got $mode" >&2; exit 2 ;;
    esac
    dir="$(cd "$dir" && pwd)"
    # Engine i's core; engines that share one run in one process each (see
    # RADIXGATE_VLLM_INPROC above).
    local pinned=() shared=0
    for i in $(seq 0 $((k - 1))); do
        local c=$((i % ncpu))
        [[ ${#cores[@]} -gt 0 ]] && c="${cores[$((i % ${#cores[@]}))]}"
        [[ " ${pinned[*]} " == *" $c "* ]] && shared=1
        pinned+=("$c")
    done
    export RADIXGATE_VLLM_INPROC="${RADIXGATE_VLLM_INPROC:-$shared}"
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
        local own_var="RADIXGATE_VLLM_ENGINE_ARGS_$i" own=()
        read -r -a own <<<"${!own_var:-}"
        launch_engine "$dir" "engine-$i" $((base + i)) "${pinned[$i]}" "$size" --kv-events-config "$kv" \
            ${common[@]+"${common[@]}"} ${own[@]+"${own[@]}"}
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

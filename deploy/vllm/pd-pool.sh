#!/usr/bin/env bash
#! Starts and stops a split prefill/decode pool of vLLM engines on loopback, for
#! radixgate's disaggregated serving (config: deploy/vllm/pd-pool.toml).
#!
#!   deploy/vllm/pd-pool.sh start STATE_DIR P D BASE_PORT [tiny|small]
#!   deploy/vllm/pd-pool.sh stop STATE_DIR
#!
#! Launches P prefill engines on BASE_PORT.. and D decode engines on BASE_PORT+10..,
#! each with `--kv-transfer-config` for CONNECTOR (default NixlConnector, the
#! connector vLLM's own disaggregated-serving proxy uses on GPUs; NIXL needs a
#! GPU build). With CONNECTOR=ExampleConnector both sides share KV through files in
#! STATE_DIR/kv (vLLM's example connector, which finds KV by prompt and returns no
#! kv_transfer_params; see README "Disaggregated prefill/decode" for what was found on
#! the CPU build). Waits for every /health, prints `ROLE ID ADDR` per engine. `stop`
#! SIGTERMs each PID (its engine processes go with it), then SIGKILLs stragglers.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=lib.sh
source "$here/lib.sh"
connector="${CONNECTOR:-NixlConnector}"

# launch DIR NAME PORT CORE SIZE: one engine with the pool's KV transfer config.
launch() {
    local dir="$1"
    mkdir -p "$dir/kv"
    local kvt
    if [[ "$connector" == ExampleConnector ]]; then
        kvt="{\"kv_connector\":\"ExampleConnector\",\"kv_role\":\"kv_both\",\"kv_connector_extra_config\":{\"shared_storage_path\":\"$dir/kv\"}}"
    else
        kvt="{\"kv_connector\":\"$connector\",\"kv_role\":\"kv_both\"}"
    fi
    launch_engine "$@" --kv-transfer-config "$kvt"
}

start() {
    local dir="$1" p="$2" d="$3" base="$4" size="${5:-tiny}"
    mkdir -p "$dir"
    prepare_model "$size"
    local ncpu names=() ports=()
    ncpu="$(nproc)"
    for i in $(seq 0 $((p - 1))); do
        launch "$dir" "prefill-$i" $((base + i)) $((i % ncpu)) "$size"
        names+=("prefill-$i"); ports+=($((base + i)))
    done
    for i in $(seq 0 $((d - 1))); do
        launch "$dir" "decode-$i" $((base + 10 + i)) $(((p + i) % ncpu)) "$size"
        names+=("decode-$i"); ports+=($((base + 10 + i)))
    done
    local deadline=$((SECONDS + ${RADIXGATE_VLLM_START_TIMEOUT:-900}))
    for j in "${!names[@]}"; do
        wait_healthy "$dir" "${names[$j]}" "${ports[$j]}" "$deadline"
    done
    for j in "${!names[@]}"; do
        echo "${names[$j]%%-*} ${names[$j]} 127.0.0.1:${ports[$j]}"
    done
}

case "${1:-}" in
    start) shift; start "$@" ;;
    stop) shift; stop_engines "$@" ;;
    *) sed -n 's/^#! \{0,1\}//p' "$0" >&2; exit 2 ;;
esac

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
cache="${RADIXGATE_CACHE:-$HOME/.cache/radixgate}"
connector="${CONNECTOR:-NixlConnector}"

stop() {
    local dir="$1"
    [[ -d "$dir" ]] || return 0
    local pids=()
    for f in "$dir"/*.pid; do
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
        kill -KILL -- "-$p" 2>/dev/null || kill -KILL "$p" 2>/dev/null || true
    done
    rm -f "$dir"/*.pid
    rm -rf /tmp/vllm_dist_* 2>/dev/null || true
}

launch() {
    local dir="$1" name="$2" port="$3" core="$4" model="$5" size="$6"
    local scratch="$dir/scratch-$name"
    mkdir -p "$scratch" "$dir/kv"
    local kvt
    if [[ "$connector" == ExampleConnector ]]; then
        kvt="{\"kv_connector\":\"ExampleConnector\",\"kv_role\":\"kv_both\",\"kv_connector_extra_config\":{\"shared_storage_path\":\"$dir/kv\"}}"
    else
        kvt="{\"kv_connector\":\"$connector\",\"kv_role\":\"kv_both\"}"
    fi
    HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" \
    VLLM_CPU_OMP_THREADS_BIND="$core" \
    VLLM_CACHE_ROOT="$scratch/vllm" TORCHINDUCTOR_CACHE_DIR="$scratch/inductor" \
    setsid "$py" -m vllm.entrypoints.openai.api_server --model "$model" \
        --served-model-name "$size" --host 127.0.0.1 --port "$port" \
        --enable-prefix-caching --enable-prompt-tokens-details --max-model-len 4096 \
        --enforce-eager --kv-transfer-config "$kvt" \
        >"$dir/$name.log" 2>&1 &
    echo $! >"$dir/$name.pid"
}

start() {
    local dir="$1" p="$2" d="$3" base="$4" size="${5:-tiny}"
    mkdir -p "$dir"
    py="$("$here/install.sh" | tail -n1)"
    local model="$cache/models/$size"
    HF_HUB_OFFLINE=1 "$py" "$here/make_model.py" "$model" "$size" >/dev/null 2>&1 \
        || { echo "make_model.py failed" >&2; exit 1; }
    local ncpu names=() ports=()
    ncpu="$(nproc)"
    for i in $(seq 0 $((p - 1))); do
        launch "$dir" "prefill-$i" $((base + i)) $((i % ncpu)) "$model" "$size"
        names+=("prefill-$i"); ports+=($((base + i)))
    done
    for i in $(seq 0 $((d - 1))); do
        launch "$dir" "decode-$i" $((base + 10 + i)) $(((p + i) % ncpu)) "$model" "$size"
        names+=("decode-$i"); ports+=($((base + 10 + i)))
    done
    local deadline=$((SECONDS + ${RADIXGATE_VLLM_START_TIMEOUT:-900}))
    for j in "${!names[@]}"; do
        until curl -sf "http://127.0.0.1:${ports[$j]}/health" >/dev/null; do
            if ! kill -0 "$(cat "$dir/${names[$j]}.pid")" 2>/dev/null || ((SECONDS > deadline)); then
                echo "${names[$j]} did not come up; log tail:" >&2
                tail -n 30 "$dir/${names[$j]}.log" >&2
                stop "$dir"; exit 1
            fi
            sleep 1
        done
    done
    for j in "${!names[@]}"; do
        echo "${names[$j]%%-*} ${names[$j]} 127.0.0.1:${ports[$j]}"
    done
}

case "${1:-}" in
    start) shift; start "$@" ;;
    stop) shift; stop "$@" ;;
    *) sed -n 's/^#! \{0,1\}//p' "$0" >&2; exit 2 ;;
esac

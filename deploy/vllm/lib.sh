# Shell functions shared by fleet.sh and pd-pool.sh: prepare the venv and model,
# launch one vLLM API server in its own process group, wait for /health, and stop
# every engine of a state directory by PID. Sourced, not run.
# shellcheck shell=bash

cache="${RADIXGATE_CACHE:-$HOME/.cache/radixgate}"

# prepare_model SIZE: installs vLLM (install.sh) and builds the model if needed; sets
# `py` (the venv's python) and `model` (the model directory).
prepare_model() {
    local size="$1"
    py="$("$here/install.sh" | tail -n1)"
    model="$cache/models/$size"
    # A model already built (make_model.py's own marker) is reused without starting Python.
    [[ -f "$model/.complete" ]] && return 0
    HF_HUB_OFFLINE=1 "$py" "$here/make_model.py" "$model" "$size" >/dev/null 2>&1 \
        || { echo "make_model.py failed" >&2; exit 1; }
}

# launch_engine DIR NAME PORT CORE SIZE [EXTRA_ARGS...]: starts an API server for
# `$model` served as SIZE on 127.0.0.1:PORT, pinned to CORE, with prefix caching and
# prompt-token details; logs to DIR/NAME.log, PID in DIR/NAME.pid. With
# RADIXGATE_VLLM_INPROC=1 the model runs in the server's own process, pinned whole to
# CORE (taskset), instead of in a worker process that busy-polls after each step.
launch_engine() {
    local dir="$1" name="$2" port="$3" core="$4" size="$5"
    shift 5
    local scratch="$dir/scratch-$name"
    mkdir -p "$scratch"
    local pin=() mp=1
    if [[ "${RADIXGATE_VLLM_INPROC:-0}" == 1 ]]; then
        pin=(taskset -c "$core")
        mp=0
    fi
    # setsid: the server leads its own process group, so stop_engines can reap it whole.
    HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" \
    VLLM_CPU_OMP_THREADS_BIND="$core" VLLM_ENABLE_V1_MULTIPROCESSING="$mp" \
    VLLM_CACHE_ROOT="$scratch/vllm" TORCHINDUCTOR_CACHE_DIR="$scratch/inductor" \
    setsid ${pin[@]+"${pin[@]}"} "$py" -m vllm.entrypoints.openai.api_server --model "$model" \
        --served-model-name "$size" --host 127.0.0.1 --port "$port" \
        --enable-prefix-caching --enable-prompt-tokens-details --max-model-len 4096 \
        --enforce-eager "$@" \
        >"$dir/$name.log" 2>&1 &
    echo $! >"$dir/$name.pid"
}

# wait_healthy DIR NAME PORT DEADLINE: waits until NAME answers /health; if it exits
# or SECONDS passes DEADLINE, prints its log tail, stops every engine and exits 1.
wait_healthy() {
    local dir="$1" name="$2" port="$3" deadline="$4"
    until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
        if ! kill -0 "$(cat "$dir/$name.pid")" 2>/dev/null || ((SECONDS > deadline)); then
            echo "$name did not come up; log tail:" >&2
            tail -n 30 "$dir/$name.log" >&2
            stop_engines "$dir"; exit 1
        fi
        sleep 1
    done
}

# stop_engines DIR: SIGTERM to every DIR/*.pid (vLLM stops its engine processes with
# it), up to 30 s of waiting, then SIGKILL to what is left; removes the PID files and
# the files vLLM leaves in /tmp.
stop_engines() {
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
        # On a hang, kill the whole process group the server leads.
        kill -KILL -- "-$p" 2>/dev/null || kill -KILL "$p" 2>/dev/null || true
    done
    rm -f "$dir"/*.pid
    rm -rf /tmp/vllm_dist_* 2>/dev/null || true
}

#!/usr/bin/env bash
# The standard benchmark clients, inference-perf (shared_prefix data) and guidellm
# (synthetic data), each for a bounded run against a fresh `radixgate demo`.
# 
# It installs the two clients at pinned versions into a virtual environment
# (PyPI; Python 3.12 or later; torch comes with guidellm, some GB), builds the
# project's offline test tokenizer (deploy/vllm/make_model.py ... tokenizer), starts
# the demo with that tokenizer on an ephemeral port, runs inference-perf with
# perf/clients/inference-perf.yaml, then guidellm, and prints each one's validation
# result and TTFT. The demo is stopped by its PID on exit, whatever happens. Not
# part of the test suite (slow, needs PyPI); see docs/engine-sim.md, "Standard
# benchmark clients".
# 
# Usage: perf/clients.sh [OUT_DIR]      (default target/clients)
# Environment: CLIENTS_VENV (default ~/.cache/radixgate/clients-venv),
#   RADIXGATE_BIN (default: target/release/radixgate, built when missing),
#   PYTHON (an interpreter of 3.12 or later, found when unset).
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
out=$(mkdir -p "${1:-$repo/target/clients}" && cd "${1:-$repo/target/clients}" && pwd)
venv=${CLIENTS_VENV:-$HOME/.cache/radixgate/clients-venv}
bin=${RADIXGATE_BIN:-$repo/target/release/radixgate}
export HF_HUB_OFFLINE=1 # the tokenizer is local; nothing is fetched from a hub

find_python() {
    local candidates=("${PYTHON:-}" python3.13 python3.12 python3)
    if command -v pyenv >/dev/null 2>&1; then
        candidates+=("$(pyenv root)"/versions/3.1[2-9]*/bin/python3)
    fi
    for py in "${candidates[@]}"; do
        [ -n "$py" ] && command -v "$py" >/dev/null 2>&1 || continue
        if "$py" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
            echo "$py"
            return
        fi
    done
    echo "perf/clients.sh: inference-perf 0.7.0 needs Python 3.12 or later; set PYTHON" >&2
    exit 1
}

# --- the clients, pinned ---
if ! "$venv/bin/inference-perf" --help >/dev/null 2>&1 || ! "$venv/bin/guidellm" --version >/dev/null 2>&1; then
    py=$(find_python)
    echo "installing inference-perf 0.7.0 and guidellm 0.8.1 into $venv ($py)"
    "$py" -m venv "$venv"
    "$venv/bin/pip" install -q 'inference-perf==0.7.0' 'guidellm==0.8.1'
fi

# --- the tokenizer both clients and the demo count with ---
tok="$out/tokenizer"
"$venv/bin/python" "$repo/deploy/vllm/make_model.py" "$tok" tokenizer >/dev/null

# --- a fresh demo, stopped by its PID on exit ---
if [ ! -x "$bin" ]; then
    (cd "$repo" && nice cargo build --release --bin radixgate)
fi
demo_pid=
cleanup() {
    if [ -n "$demo_pid" ]; then
        kill "$demo_pid" 2>/dev/null || true
        wait "$demo_pid" 2>/dev/null || true
    fi
}
trap cleanup EXIT
"$bin" demo --listen 127.0.0.1:0 --tokenizer "$tok/tokenizer.json" >"$out/demo.log" 2>&1 &
demo_pid=$!
url=
for _ in $(seq 100); do
    url=$(grep -o 'gateway on http://[0-9.:]*' "$out/demo.log" | head -1 | cut -d' ' -f3 || true)
    [ -n "$url" ] && break
    kill -0 "$demo_pid" 2>/dev/null || { cat "$out/demo.log" >&2; exit 1; }
    sleep 0.1
done
[ -n "$url" ] || { echo "the demo printed no address" >&2; cat "$out/demo.log" >&2; exit 1; }
echo "demo: $url (pid $demo_pid), tokenizer $tok"

# --- inference-perf: shared_prefix data, 8 requests/s for 30 s ---
ip_out="$out/inference-perf"
rm -rf "$ip_out"
timeout 300 "$venv/bin/inference-perf" --config_file "$repo/perf/clients/inference-perf.yaml" \
    --server.base_url "$url" \
    --tokenizer.pretrained_model_name_or_path "$tok" \
    --storage.local_storage.path "$ip_out" >"$out/inference-perf.log" 2>&1
echo "inference-perf: $(grep -o 'Report validation finished: .*' "$out/inference-perf.log")"

# --- guidellm: synthetic data, 5 requests/s for 24 s ---
gl_out="$out/guidellm"
rm -rf "$gl_out"
mkdir -p "$gl_out"
(cd "$gl_out" && timeout 300 "$venv/bin/guidellm" run \
    --backend "kind=openai_http,target=$url,model=sim,request_format=/v1/chat/completions" \
    --tokenizer "kind=huggingface_auto,model=$tok,load_kwargs.model_max_length=65536" \
    --profile kind=constant,rate=5 \
    --constraint kind=max_duration,seconds=24 \
    --data kind=synthetic_text,prompt_tokens=3072,output_tokens=32 \
    --data-loader kind=pytorch,samples=128 \
    --output "kind=json,path=$gl_out/benchmarks.json" --output kind=console \
    --disable-console-interactive) >"$out/guidellm.log" 2>&1

# --- what they measured ---
"$venv/bin/python" - "$ip_out" "$gl_out/benchmarks.json" <<'EOF'
import json, sys
ip, gl = sys.argv[1], sys.argv[2]
v = json.load(open(f"{ip}/validation.json"))
findings = sum(len(r["warnings"]) + len(r["errors"]) for r in [v["global"], *v["reports"].values()])
s = json.load(open(f"{ip}/summary_lifecycle_metrics.json"))["successes"]
t = s["latency"]["time_to_first_token"]
print(f"inference-perf: {s['count']} ok, {findings} validation findings, "
      f"{s['token_count_mismatches']} token-count mismatches; "
      f"TTFT mean {t['mean'] * 1e3:.1f} ms, median {t['median'] * 1e3:.1f} ms, p90 {t['p90'] * 1e3:.1f} ms; "
      f"{s['throughput']['requests_per_sec']:.1f} requests/s, "
      f"{s['throughput']['output_tokens_per_sec']:.0f} output tokens/s")
b = json.load(open(gl))["benchmarks"][0]
m = b["metrics"]
t = m["time_to_first_token_ms"]["successful"]
totals = m["request_totals"]
print(f"guidellm: {totals['successful']} ok, {totals['errored']} errored, "
      f"{totals['incomplete']} cut at the end, {len(b['warnings'])} warnings "
      f"{[w['message'] for w in b['warnings']]}; TTFT mean {t['mean']:.1f} ms, "
      f"median {t['median']:.1f} ms, p95 {t['percentiles']['p95']:.1f} ms; "
      f"{m['requests_per_second']['successful']['mean']:.1f} requests/s, "
      f"{m['output_tokens_per_second']['successful']['mean']:.0f} output tokens/s")
EOF
echo "logs and reports: $out"

#!/usr/bin/env bash
# The capacity signal's model against simulated engines (docs/capacity.md,
# "Validation"): ENGINES `radixgate engine-sim`s of SLOTS slots each, no prefill
# cost, TOKENS output tokens at DECODE_US each (a fixed service time), behind a
# fresh gateway per offered load; `radixgate-bench load --rate R` sends open-loop
# Poisson arrivals for DURATION seconds; then GET /admin/capacity gives the model's
# queue at the current engine count. Prints one Markdown row per rate: the offered
# and measured rate, the measured service time, utilisation, the model's wait
# (mean, p50, p90, p99) against the observed one (the engines' mean wait by
# Little's law; the clients' TTFT quantiles, which are the wait for a slot plus the
# gateway's overhead, the sims having no prefill cost), and the recommendation.
# Every process is stopped by its PID on exit. Loopback only; each run is bounded
# by DURATION (default 60 s).
#
# Usage: perf/capacity.sh [OUT_DIR]       (default target/capacity)
# Environment: RATES (default "8 12 15 17 18"), DURATION, ENGINES (2), SLOTS (4),
#   TOKENS (16), DECODE_US (25000), SLO_MS (2000), RADIXGATE_BIN and BENCH_BIN
#   (default: the debug builds in target/, built when missing).
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
out=$(mkdir -p "${1:-$repo/target/capacity}" && cd "${1:-$repo/target/capacity}" && pwd)
bin=${RADIXGATE_BIN:-$repo/target/debug/radixgate}
bench=${BENCH_BIN:-$repo/target/debug/radixgate-bench}
RATES=${RATES:-"8 12 15 17 18"}
DURATION=${DURATION:-60}
ENGINES=${ENGINES:-2}
SLOTS=${SLOTS:-4}
TOKENS=${TOKENS:-16}
DECODE_US=${DECODE_US:-25000}
SLO_MS=${SLO_MS:-2000}
TOKEN=capacity-validation-token-0123

if [ ! -x "$bin" ] || [ ! -x "$bench" ]; then
    (cd "$repo" && cargo build --bin radixgate && cargo build -p radixgate-bench)
fi

pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'; }
wait_port() { for _ in $(seq 1 3000); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.01; done; echo "port $1 never opened" >&2; exit 1; }

echo "$TOKEN" >"$out/admin.token"
backends=""
for i in $(seq 0 $((ENGINES - 1))); do
    port=$(free_port)
    "$bin" engine-sim --listen "127.0.0.1:$port" --prefill-us-per-token 0 \
        --decode-us-per-token "$DECODE_US" --max-batch "$SLOTS" --max-waiting 100000 \
        >"$out/engine$i.log" 2>&1 &
    pids+=($!)
    wait_port "$port"
    backends+="
[[backends]]
id = \"e$i\"
url = \"http://127.0.0.1:$port\"
models = [\"sim\"]
"
done

echo "| offered req/s | measured req/s | service s | utilisation | model wait mean / p50 / p90 / p99 ms | observed wait mean (engines, Little) ms | observed TTFT p50 / p90 / p99 ms | recommended engines (busy now) |"
echo "|---|---|---|---|---|---|---|---|"
for rate in $RATES; do
    gw_port=$(free_port)
    admin_port=$(free_port)
    cat >"$out/gateway-$rate.toml" <<EOF
[server]
listen = "127.0.0.1:$gw_port"
shards = 1
[routing]
policy = "least_loaded"
[health]
scrape_interval_ms = 250
[admin]
listen = "127.0.0.1:$admin_port"
token_file = "$out/admin.token"
[log]
access = false
[capacity]
ttft_slo_ms = $SLO_MS
engine_slots = $SLOTS
interval_ms = 1000
window_ms = $((DURATION * 1000))
$backends
EOF
    "$bin" serve --config "$out/gateway-$rate.toml" >"$out/gateway-$rate.log" 2>&1 &
    gw_pid=$!
    pids+=($gw_pid)
    wait_port "$gw_port"
    "$bench" load --url "http://127.0.0.1:$gw_port/v1/chat/completions" --rate "$rate" \
        --duration-secs "$DURATION" --requests 0 --concurrency 256 --workload fixed \
        --body-bytes 512 --max-tokens "$TOKENS" --stream --json >"$out/load-$rate.json" \
        2>"$out/load-$rate.err"
    curl -s -H "Authorization: Bearer $TOKEN" "http://127.0.0.1:$admin_port/admin/capacity" \
        >"$out/capacity-$rate.json"
    kill "$gw_pid"
    wait "$gw_pid" 2>/dev/null || true
    python3 - "$rate" "$out/load-$rate.json" "$out/capacity-$rate.json" <<'EOF'
import json, math, sys
rate, load, cap = float(sys.argv[1]), json.load(open(sys.argv[2])), json.load(open(sys.argv[3]))
p = next(x for x in cap["pools"] if x["pool"] == "sim")
i, cur = p["inputs"], p["current"]
lam, s = i["arrival_rate"], i["service_seconds"]
servers = p["observed"]["engines"] * cap["engine_slots"]
def quantile(q):
    if cur is None:
        return float("inf")
    c, drain = cur["wait_probability"], servers / s - lam
    return 0.0 if c <= 1 - q else math.log(c / (1 - q)) / drain * 1000
mean = cur["mean_wait_seconds"] * 1000 if cur else float("inf")
ttft = load["ttft_ms"]
util = cur["utilisation"] if cur else float("nan")
print(f"| {rate:g} | {lam:.2f} | {s:.3f} | {util:.2f} | {mean:.0f} / {quantile(0.5):.0f} / {quantile(0.9):.0f} / {quantile(0.99):.0f} "
      f"| {i['engine_queue_seconds'] * 1000:.0f} | {ttft['p50']:.0f} / {ttft['p90']:.0f} / {ttft['p99']:.0f} "
      f"| {p['recommended_engines']} ({p['observed']['busy_engines']}) |")
EOF
done

#!/usr/bin/env bash
# Soak: a long bounded run against simulated engines on loopback while sampling the
# gateway's RSS. Pass = zero errors and memory flat after warm-up (the last sample at
# most 10% above the sample taken once 10% of the requests were done).
#
#   perf/soak.sh [REQUESTS] [CONCURRENCY]     (defaults: 1000000, 32)
#
# Starts 3 `radixgate engine-sim` (answering at once) and `radixgate serve` (2 shards,
# prefix_aware) on free loopback ports, drives them with `radixgate-bench load` (docs
# workload), writes perf/SOAK.md, and stops every process it started, by PID.
set -euo pipefail
cd "$(dirname "$0")/.."
REQUESTS=${1:-1000000}
CONCURRENCY=${2:-32}
cargo build --release -q -p radixgate -p radixgate-bench
BIN=target/release
WORK=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'; }

BACKENDS=""
for i in 0 1 2; do
  port=$(free_port)
  "$BIN/radixgate" engine-sim --listen "127.0.0.1:$port" --prefill-us-per-token 0 \
    --decode-us-per-token 0 --default-max-tokens 4 --max-batch 256 --seed "$((i + 1))" \
    >"$WORK/engine$i.log" 2>&1 &
  PIDS+=($!)
  BACKENDS+=$'\n'"[[backends]]"$'\n'"id = \"sim-$i\""$'\n'"url = \"http://127.0.0.1:$port\""$'\n'"models = [\"sim\"]"$'\n'"cache_blocks = 4096"$'\n'
done
GW_PORT=$(free_port)
cat >"$WORK/gw.toml" <<TOML
[server]
listen = "127.0.0.1:$GW_PORT"
shards = 2
[log]
access = false
$BACKENDS
TOML
"$BIN/radixgate" serve --config "$WORK/gw.toml" >"$WORK/gw.log" 2>&1 &
GW_PID=$!
PIDS+=($GW_PID)
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$GW_PORT/ready" >/dev/null && break; sleep 0.1; done

rss_kb() { awk '/VmRSS/ {print $2}' "/proc/$GW_PID/status"; }
: >"$WORK/rss.csv"
(
  start=$(date +%s)
  while kill -0 "$GW_PID" 2>/dev/null; do
    echo "$(( $(date +%s) - start )),$(rss_kb)" >>"$WORK/rss.csv"
    sleep 2
  done
) &
SAMPLER=$!
PIDS+=($SAMPLER)

START=$(date +%s)
"$BIN/radixgate-bench" load --url "http://127.0.0.1:$GW_PORT/v1/chat/completions" \
  --concurrency "$CONCURRENCY" --requests "$REQUESTS" --workload docs --max-tokens 4 \
  --json >"$WORK/load.json"
ELAPSED=$(( $(date +%s) - START ))
kill "$SAMPLER" 2>/dev/null || true

python3 - "$WORK" "$REQUESTS" "$CONCURRENCY" "$ELAPSED" <<'PY'
import json, sys, subprocess, datetime, platform
work, requests, conc, elapsed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
load = json.load(open(f"{work}/load.json"))
rss = [tuple(map(int, l.split(","))) for l in open(f"{work}/rss.csv") if l.strip() and l.strip().split(",")[1]]
ok = load.get("requests_ok", 0)
errors = requests - ok
warm = rss[min(len(rss) - 1, len(rss) // 10)][1] if rss else 0
last = rss[-1][1] if rss else 0
peak = max((r for _, r in rss), default=0)
flat = warm > 0 and last <= warm * 1.10
passed = errors == 0 and flat
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
out = f"""# Soak result

- date: {datetime.date.today()}, commit {commit}, host: {cpu}, {subprocess.run(['nproc'], capture_output=True, text=True).stdout.strip()} cores, Linux {platform.release()}
- command: `perf/soak.sh {requests} {conc}` (3 engine-sims answering at once, `radixgate serve` with 2 shards, `radixgate-bench load --workload docs --concurrency {conc}`)
- requests: {requests}, ok: {ok}, errors: {errors}, wall time: {elapsed} s ({requests / max(elapsed, 1):.0f} req/s)
- gateway RSS: {warm} KiB after warm-up (10% of samples), {last} KiB at the end, peak {peak} KiB, {len(rss)} samples
- result: **{'PASS' if passed else 'FAIL'}** (zero errors: {errors == 0}; memory flat within 10% after warm-up: {flat})
"""
open("perf/SOAK.md", "w").write(out)
print(out)
sys.exit(0 if passed else 1)
PY

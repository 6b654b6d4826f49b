#!/usr/bin/env bash
# Side-by-side proxy comparison on loopback: radixgate against nginx, HAProxy, SGLang's
# router and vLLM's router, all in front of the same simulated engines, in one run.
#
#   perf/compare.sh                       (defaults below; writes perf/RESULTS.md)
#   DURATION=5 ONLY='nginx|radixgate-pa-1s-uring' perf/compare.sh
#
# Knobs (environment):
#   DURATION=8          seconds of wrk load per (proxy, body, concurrency) cell
#   WARMUP=2            seconds of unmeasured load after each proxy starts
#   BODIES="2048 16384 131072"  chat body sizes in bytes (131072: long prompts; the
#                       report adds MB/s of bodies through each proxy against direct)
#   CONCS="1 64 256"    wrk connections
#   ROUNDS=1            interleaved rounds over the proxy list (medians reported)
#   ONLY=regex          only proxies whose name matches (direct and nginx are always
#                       kept: they are the floor and the reference)
#   PROXY_CORE=1 LOAD_CORE=0   taskset cores: the proxy alone on PROXY_CORE; wrk and
#                       the engines on LOAD_CORE
#   OUT=perf/RESULTS.md  report; the raw rows go next to it as results.jsonl
#   NICE=-10            nice level of everything started (default -10 as root, else 0)
#   OHA=1               also take latency distributions at concurrency 1 with oha
#                       (only if `oha` is installed; wrk stays the load generator)
#   BIN=path            a given radixgate binary instead of building this checkout
#
# What it does: installs its tools if missing (perf/setup.sh), builds radixgate in
# release, starts 2 `radixgate engine-sim --fixed-response` (answer at once with a
# small constant body), then for each proxy: start it pinned, wait until it serves a
# chat completion, warm up, and for each body size and concurrency run wrk (Lua POST)
# while reading the CPU time of the proxy's processes (all threads, children
# included) from /proc/PID/stat before and after. Every process it starts is
# stopped by PID on exit; its temp dir is removed.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

DURATION=${DURATION:-8}
WARMUP=${WARMUP:-2}
BODIES=${BODIES:-"2048 16384 131072"}
CONCS=${CONCS:-"1 64 256"}
ROUNDS=${ROUNDS:-1}
ONLY=${ONLY:-}
PROXY_CORE=${PROXY_CORE:-1}
LOAD_CORE=${LOAD_CORE:-0}
OUT=${OUT:-perf/RESULTS.md}
OHA=${OHA:-0}
NICE=${NICE:-$([ "$(id -u)" = 0 ] && echo -10 || echo 0)}
VENV=${PERF_VENV:-$HOME/.cache/radixgate/perf-venv}

"$ROOT/perf/setup.sh"
# BIN=path/to/radixgate runs that binary (gateway and engines) instead of building
# this checkout, as perf/callgrind.sh does.
if [ -z "${BIN:-}" ]; then
  cargo build --release -q -p radixgate
  BIN=$ROOT/target/release/radixgate
fi

WORK=$(mktemp -d /tmp/radixgate-compare.XXXXXX)
chmod 755 "$WORK" # nginx workers may run as another user
ENGINE_PIDS=()
PROXY_PIDS=()
tree() { # PIDs and all their descendants
  local p
  for p in "$@"; do
    echo "$p"
    # shellcheck disable=SC2046
    tree $(pgrep -P "$p" || true)
  done
}
stop_pids() { # by PID, with every descendant (routers may fork, nginx has workers)
  local p all
  all=$(tree "$@")
  for p in $all; do kill "$p" 2>/dev/null || true; done
  for p in $all; do
    for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$p" 2>/dev/null || true
    wait "$p" 2>/dev/null || true
  done
}
cleanup() {
  stop_pids "${PROXY_PIDS[@]}" "${ENGINE_PIDS[@]}"
  rm -rf "$WORK"
}
trap cleanup EXIT

# Every process the harness starts runs pinned and, by default, at nice -10: on a
# shared machine that keeps other people's jobs from deciding which proxy wins.
# (Arrays, not a function: `f &` would fork a subshell and $! would not be the PID.)
PIN_PROXY=(nice -n "$NICE" taskset -c "$PROXY_CORE")
PIN_LOAD=(nice -n "$NICE" taskset -c "$LOAD_CORE")
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'; }
log() { printf '[compare %s] %s\n' "$(date +%T)" "$*" >&2; }

# === bodies and the wrk script ===
for size in $BODIES; do
  python3 - "$size" >"$WORK/body-$size.json" <<'PY'
import json, sys
size = int(sys.argv[1])
words = "the router keeps every prompt prefix on the engine that already holds it in cache ".split()
def body(n):
    text = " ".join(words[i % len(words)] for i in range(n))
    return json.dumps({"model": "sim", "max_tokens": 4, "messages": [
        {"role": "system", "content": "You are a helpful assistant. " + text},
        {"role": "user", "content": "Summarise the above."}]}, separators=(",", ":"))
n = 1
while len(body(n * 2)) <= size: n *= 2
lo, hi = n, n * 2
while lo + 1 < hi:
    mid = (lo + hi) // 2
    lo, hi = (mid, hi) if len(body(mid)) <= size else (lo, mid)
b = body(lo)
b = b.replace("Summarise the above.", "Summarise the above." + "!" * (size - len(b)), 1)
assert len(b) == size, (len(b), size)
sys.stdout.write(b)
PY
done
cat >"$WORK/post.lua" <<'LUA'
local f = assert(io.open(os.getenv("BODY_FILE"), "rb"))
wrk.method = "POST"
wrk.body = f:read("*a")
f:close()
wrk.headers["Content-Type"] = "application/json"
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {"requests":%d,"duration_us":%d,"err_connect":%d,"err_read":%d,' ..
    '"err_write":%d,"err_status":%d,"err_timeout":%d,"p50_us":%d,"p99_us":%d,' ..
    '"mean_us":%.1f,"max_us":%d}\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status,
    e.timeout, latency:percentile(50), latency:percentile(99), latency.mean,
    latency.max))
end
LUA

# CPU ticks (utime+stime, all threads) of the given PIDs and their descendants.
cpu_ticks() {
  python3 - "$@" <<'PY'
import os, sys
roots = {int(p) for p in sys.argv[1:]}
stats = {}
for d in os.listdir("/proc"):
    if d.isdigit():
        try:
            s = open(f"/proc/{d}/stat").read()
        except OSError:
            continue
        f = s[s.rindex(")") + 2:].split()
        stats[int(d)] = (int(f[1]), int(f[11]) + int(f[12]))  # ppid, utime+stime
keep, grew = set(r for r in roots if r in stats), True
while grew:
    grew = False
    for pid, (ppid, _) in stats.items():
        if ppid in keep and pid not in keep:
            keep.add(pid); grew = True
print(sum(stats[p][1] for p in keep))
PY
}
CLK_TCK=$(getconf CLK_TCK)

# === engines ===
ENGINE_PORTS=()
for i in 0 1; do
  port=$(free_port)
  "${PIN_LOAD[@]}" "$BIN" engine-sim --listen "127.0.0.1:$port" --fixed-response \
    --seed "$((i + 1))" >"$WORK/engine$i.log" 2>&1 &
  ENGINE_PIDS+=($!)
  ENGINE_PORTS+=("$port")
done
FIRST_BODY=$WORK/body-${BODIES%% *}.json
wait_serving() { # URL: until a chat completion comes back 200 (or 90 s)
  local i
  for i in $(seq 900); do
    if curl -sf -m 2 -o /dev/null -H 'content-type: application/json' \
      --data-binary "@$FIRST_BODY" "$1/v1/chat/completions"; then
      return 0
    fi
    sleep 0.1
  done
  return 1
}
for port in "${ENGINE_PORTS[@]}"; do wait_serving "http://127.0.0.1:$port"; done
E0=http://127.0.0.1:${ENGINE_PORTS[0]}
E1=http://127.0.0.1:${ENGINE_PORTS[1]}

# === proxies: start_<kind> PORT ARGS... starts it pinned and appends its PID ===
start_direct() { :; }
start_nginx() {
  local port=$1 d=$WORK/nginx
  mkdir -p "$d"
  { [ "$(id -u)" = 0 ] && echo "user $(id -un);"
    cat <<NGINX
worker_processes 1;
daemon off;
pid $d/nginx.pid;
error_log $d/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $d/body; proxy_temp_path $d/proxy; fastcgi_temp_path $d/fcgi;
  uwsgi_temp_path $d/uwsgi; scgi_temp_path $d/scgi;
  # Whole bodies in memory up to 1 MB (the default 16k would spill 128 KB prompts to
  # a temp file on disk; nginx buffers a request body before proxying it).
  client_body_buffer_size 1m;
  client_max_body_size 8m;
  keepalive_requests 10000000;
  keepalive_timeout 300s;
  upstream engines {
    server ${E0#http://};
    server ${E1#http://};
    keepalive 512;
    keepalive_requests 10000000;
  }
  server {
    listen 127.0.0.1:$port;
    location / {
      proxy_pass http://engines;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
    }
  }
}
NGINX
  } >"$d/nginx.conf"
  "${PIN_PROXY[@]}" nginx -p "$d" -c "$d/nginx.conf" -e "$d/error.log" >"$d/out.log" 2>&1 &
  PROXY_PIDS+=($!)
}
start_haproxy() {
  local port=$1 d=$WORK/haproxy
  mkdir -p "$d"
  cat >"$d/haproxy.cfg" <<HAP
global
  nbthread 1
  maxconn 8000
defaults
  mode http
  timeout connect 5s
  timeout client 300s
  timeout server 300s
  option http-keep-alive
  http-reuse always
frontend fe
  bind 127.0.0.1:$port
  default_backend engines
backend engines
  balance roundrobin
  server e0 ${E0#http://}
  server e1 ${E1#http://}
HAP
  "${PIN_PROXY[@]}" haproxy -db -f "$d/haproxy.cfg" >"$d/out.log" 2>&1 &
  PROXY_PIDS+=($!)
}
start_sglang() { # PORT POLICY
  "${PIN_PROXY[@]}" "$VENV/bin/sglang-router" launch --host 127.0.0.1 --port "$1" \
    --worker-urls "$E0" "$E1" --policy "$2" --log-level warn >"$WORK/sglang-$2.log" 2>&1 &
  PROXY_PIDS+=($!)
}
start_vllm() { # PORT POLICY
  "${PIN_PROXY[@]}" "$VENV/bin/vllm-router" --host 127.0.0.1 --port "$1" \
    --worker-urls "$E0" "$E1" --policy "$2" --log-level warning \
    --max-concurrent-requests 100000 --rate-limit-tokens-per-second 100000000 \
    >"$WORK/vllm-$2.log" 2>&1 &
  PROXY_PIDS+=($!)
}
# Pinned by taskset like every peer, so no server.cores: radixgate checks core ids
# against the cores its affinity mask shows, and under taskset that is one.
start_radixgate() { # PORT POLICY SHARDS IO
  local cfg=$WORK/radixgate-$2-$3-$4.toml
  cat >"$cfg" <<TOML
[server]
listen = "127.0.0.1:$1"
shards = $3
io = "$4"
[routing]
policy = "$2"
[log]
level = "warn"
access = false
[[backends]]
id = "e0"
url = "$E0"
models = ["sim"]
[[backends]]
id = "e1"
url = "$E1"
models = ["sim"]
TOML
  "${PIN_PROXY[@]}" "$BIN" serve --config "$cfg" >"$cfg.log" 2>&1 &
  PROXY_PIDS+=($!)
}

# name | start command (after the port) | description for the report
PROXIES=(
  "direct|direct|no proxy: wrk straight to one engine (the floor)"
  "nginx|nginx|nginx $(nginx -v 2>&1 | sed 's|.*/||'), 1 worker, round robin, upstream keepalive 512"
  "haproxy|haproxy|HAProxy $(haproxy -v | awk 'NR==1{print $3}'), nbthread 1, roundrobin, http-reuse always"
  "sglang-rr|sglang round_robin|sglang-router $("$VENV/bin/pip" show sglang-router 2>/dev/null | awk '/^Version/{print $2}') round_robin"
  "sglang-cache|sglang cache_aware|sglang-router cache_aware"
  "vllm-rr|vllm round_robin|vllm-router $("$VENV/bin/pip" show vllm-router 2>/dev/null | awk '/^Version/{print $2}') round_robin"
  "vllm-cache|vllm cache_aware|vllm-router cache_aware (calls /v1/chat/completions/render per request)"
  "radixgate-rr-1s-uring|radixgate round_robin 1 io_uring|radixgate round_robin, 1 shard, io_uring"
  "radixgate-rr-1s-epoll|radixgate round_robin 1 epoll|radixgate round_robin, 1 shard, epoll"
  "radixgate-pa-1s-uring|radixgate prefix_aware 1 io_uring|radixgate prefix_aware, 1 shard, io_uring"
  "radixgate-pa-1s-epoll|radixgate prefix_aware 1 epoll|radixgate prefix_aware, 1 shard, epoll"
  "radixgate-rr-2s-uring|radixgate round_robin 2 io_uring|radixgate round_robin, 2 shards (both on the proxy core), io_uring"
  "radixgate-rr-2s-epoll|radixgate round_robin 2 epoll|radixgate round_robin, 2 shards (both on the proxy core), epoll"
  "radixgate-pa-2s-uring|radixgate prefix_aware 2 io_uring|radixgate prefix_aware, 2 shards (both on the proxy core), io_uring"
  "radixgate-pa-2s-epoll|radixgate prefix_aware 2 epoll|radixgate prefix_aware, 2 shards (both on the proxy core), epoll"
)

RAW=$WORK/results.jsonl
: >"$RAW"
: >"$WORK/proxies.txt"
for entry in "${PROXIES[@]}"; do
  IFS='|' read -r name _ desc <<<"$entry"
  if [ -z "$ONLY" ] || [[ $name =~ ^(direct|nginx)$ ]] || [[ $name =~ $ONLY ]]; then
    printf '%s|%s\n' "$name" "$desc" >>"$WORK/proxies.txt"
  fi
done
LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
STARTED=$(date +%s)

measure() { # NAME URL PIDS... : one wrk run per body and concurrency
  local name=$1 url=$2 size conc out ticks0 ticks1 eticks0 eticks1 j
  shift 2
  for size in $BODIES; do
    for conc in $CONCS; do
      ticks0=$(cpu_ticks "$@" 0)
      eticks0=$(cpu_ticks "${ENGINE_PIDS[@]}")
      out=$(BODY_FILE=$WORK/body-$size.json "${PIN_LOAD[@]}" wrk -t1 -c"$conc" \
        -d"${DURATION}s" -s "$WORK/post.lua" "$url/v1/chat/completions" 2>&1) || true
      ticks1=$(cpu_ticks "$@" 0)
      eticks1=$(cpu_ticks "${ENGINE_PIDS[@]}")
      j=$(grep -o 'WRKJSON .*' <<<"$out" | cut -d' ' -f2- || true)
      if [ -z "$j" ]; then
        log "$name body=$size c=$conc: wrk gave no result: $(tail -c 300 <<<"$out")"
        j='{"requests":0,"duration_us":1}'
      fi
      python3 - "$name" "$size" "$conc" "$ROUND" "$((ticks1 - ticks0))" \
        "$((eticks1 - eticks0))" "$CLK_TCK" "$j" >>"$RAW" <<'PY'
import json, sys
name, size, conc, rnd, ticks, eticks, hz, j = sys.argv[1:]
w = json.loads(j)
n = w["requests"]
errors = sum(w.get(k, 0) for k in ("err_connect", "err_read", "err_write", "err_status", "err_timeout"))
row = dict(proxy=name, body=int(size), conc=int(conc), round=int(rnd), requests=n,
           errors=errors, rps=n / (w["duration_us"] / 1e6),
           p50_us=w.get("p50_us"), p99_us=w.get("p99_us"), mean_us=w.get("mean_us"),
           cpu_us_per_req=(int(ticks) / int(hz) * 1e6 / n) if n and name != "direct" else None,
           engine_cpu_us_per_req=(int(eticks) / int(hz) * 1e6 / n) if n else None)
print(json.dumps(row))
PY
      log "$name body=$size c=$conc: $(tail -n1 "$RAW")"
      if [ "$OHA" = 1 ] && [ "$conc" = 1 ] && command -v oha >/dev/null; then
        "${PIN_LOAD[@]}" oha -z "${DURATION}s" -c 1 --no-tui --json -m POST \
          -H 'content-type: application/json' -D "$WORK/body-$size.json" \
          "$url/v1/chat/completions" >"$WORK/oha.json" 2>/dev/null || true
        python3 - "$name" "$size" "$ROUND" "$WORK/oha.json" >>"$WORK/oha.jsonl" <<'PY' || true
import json, sys
name, size, rnd, path = sys.argv[1:]
o = json.load(open(path))
p = o["latencyPercentiles"]
print(json.dumps(dict(proxy=name, body=int(size), round=int(rnd),
    p50_us=p["p50"] * 1e6, p99_us=p["p99"] * 1e6, p999_us=p.get("p99.9", 0) * 1e6)))
PY
      fi
    done
  done
}

for ROUND in $(seq "$ROUNDS"); do
  while IFS='|' read -r name _; do
    spec=""
    for entry in "${PROXIES[@]}"; do
      IFS='|' read -r n s _ <<<"$entry"
      [ "$n" = "$name" ] && spec=$s
    done
    read -r kind args <<<"$spec"
    before=${#PROXY_PIDS[@]}
    if [ "$kind" = direct ]; then
      url=$E0
      pids=()
    else
      port=$(free_port)
      # shellcheck disable=SC2086
      "start_$kind" "$port" $args
      pids=("${PROXY_PIDS[@]:$before}")
      url=http://127.0.0.1:$port
      if ! wait_serving "$url"; then
        log "$name did not serve within 90 s; skipped (logs: $(ls "$WORK"))"
        stop_pids "${pids[@]}"
        continue
      fi
    fi
    log "round $ROUND: $name ready at $url"
    BODY_FILE=$FIRST_BODY "${PIN_LOAD[@]}" \
      wrk -t1 -c64 -d"${WARMUP}s" -s "$WORK/post.lua" "$url/v1/chat/completions" >/dev/null 2>&1 || true
    measure "$name" "$url" "${pids[@]}"
    stop_pids "${pids[@]}"
    PROXY_PIDS=("${PROXY_PIDS[@]:0:$before}")
  done <"$WORK/proxies.txt"
done

LOAD_END=$(cut -d' ' -f1-3 /proc/loadavg)
ELAPSED=$(($(date +%s) - STARTED))
cp "$RAW" "$(dirname "$OUT")/results.jsonl"
[ -f "$WORK/oha.jsonl" ] && cp "$WORK/oha.jsonl" "$(dirname "$OUT")/oha.jsonl"
CMD="perf/compare.sh"
for v in DURATION WARMUP BODIES CONCS ROUNDS ONLY PROXY_CORE LOAD_CORE OHA NICE; do
  def=""
  case $v in DURATION) def=8 ;; WARMUP) def=2 ;; BODIES) def="2048 16384 131072" ;; CONCS) def="1 64 256" ;;
    ROUNDS) def=1 ;; ONLY) def="" ;; PROXY_CORE) def=1 ;; LOAD_CORE) def=0 ;; OHA) def=0 ;;
    NICE) def=$([ "$(id -u)" = 0 ] && echo -10 || echo 0) ;; esac
  [ "${!v}" != "$def" ] && CMD="$v='${!v}' $CMD"
done
python3 "$ROOT/perf/report.py" --raw "$RAW" --oha "$WORK/oha.jsonl" --proxies "$WORK/proxies.txt" \
  --out "$OUT" --command "$CMD" --duration "$DURATION" --rounds "$ROUNDS" \
  --nice "$NICE" --proxy-core "$PROXY_CORE" --load-core "$LOAD_CORE" --load-start "$LOAD_START" \
  --load-end "$LOAD_END" --elapsed "$ELAPSED"
log "wrote $OUT (${ELAPSED} s)"

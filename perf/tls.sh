#!/usr/bin/env bash
# TLS termination cost: radixgate's HTTPS listener against nginx with the same
# certificate, in front of the same engine.
#
#   perf/tls.sh                       (defaults below; ~2 min)
#   DURATION=5 CONCS="1 64" perf/tls.sh
#   BIN=/tmp/radixgate-head perf/tls.sh   (a given binary, not this checkout)
#
#   DURATION=10        seconds per measurement
#   CONCS="1 64"       wrk connections for the kept-alive rows
#   KEY=ec             ec (P-256) or rsa (2048): the certificate's key, both proxies
#   PROXY_CORE=1 LOAD_CORE=0   taskset cores, as compare.sh
#
# Starts one `radixgate engine-sim --fixed-response`, makes a self-signed
# certificate with the openssl CLI, and measures each proxy (radixgate: 1 shard,
# epoll and io_uring; nginx: 1 worker, `ssl_session_cache off` and no tickets, so
# both do a full handshake per connection):
#   - handshakes/s: `openssl s_time -new` (one new TLS connection and one GET /health
#     per handshake, sequential, for DURATION seconds), with the proxy's CPU µs per
#     handshake from /proc/PID/stat;
#   - kept-alive requests: wrk over https (Lua POST of a 2 KB chat body) at each
#     concurrency: req/s, p50/p99 and the proxy's CPU µs per request.
# Rows print as Markdown; paste them into perf/RESULTS-notes.md with the date.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
DURATION=${DURATION:-10}
CONCS=${CONCS:-"1 64"}
KEY=${KEY:-ec}
PROXY_CORE=${PROXY_CORE:-1}
LOAD_CORE=${LOAD_CORE:-0}

# nginx (nginx-light is enough: it has the ssl module) and wrk, as perf/setup.sh
# installs them, without setup.sh's Python routers.
missing=()
command -v nginx >/dev/null || missing+=(nginx-light)
command -v wrk >/dev/null || missing+=(wrk)
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get install -y "${missing[@]}" >/dev/null ||
    { $SUDO apt-get update >/dev/null && $SUDO apt-get install -y "${missing[@]}" >/dev/null; }
  $SUDO service nginx stop >/dev/null 2>&1 || true
fi
command -v openssl >/dev/null || { echo "perf/tls.sh: needs the openssl CLI" >&2; exit 1; }
if [ -z "${BIN:-}" ]; then
  cargo build --release -q -p radixgate
  BIN=$ROOT/target/release/radixgate
fi

WORK=$(mktemp -d /tmp/radixgate-tls.XXXXXX)
chmod 755 "$WORK"
PIDS=()
tree() {
  local p
  for p in "$@"; do
    echo "$p"
    # shellcheck disable=SC2046
    tree $(pgrep -P "$p" || true)
  done
}
stop_pids() {
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
  stop_pids "${PIDS[@]}"
  rm -rf "$WORK"
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'; }
log() { printf '[tls %s] %s\n' "$(date +%T)" "$*" >&2; }
wait_port() {
  for _ in $(seq 100); do
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    sleep 0.1
  done
  echo "perf/tls.sh: nothing listens on $1" >&2
  return 1
}
cpu_ticks() { # utime+stime of the PIDs and their descendants
  local t=0 p
  for p in $(tree "$@"); do
    [ -r "/proc/$p/stat" ] || continue
    t=$((t + $(awk '{sub(/.*\) /, ""); print $12 + $13}' "/proc/$p/stat")))
  done
  echo "$t"
}
CLK_TCK=$(getconf CLK_TCK)
PIN_PROXY=(taskset -c "$PROXY_CORE")
PIN_LOAD=(taskset -c "$LOAD_CORE")

# === certificate, body, engine ===
case $KEY in
  ec) openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
        -subj /CN=127.0.0.1 -addext subjectAltName=IP:127.0.0.1 \
        -keyout "$WORK/key.pem" -out "$WORK/cert.pem" 2>/dev/null ;;
  rsa) openssl req -x509 -newkey rsa:2048 -nodes -days 2 \
        -subj /CN=127.0.0.1 -addext subjectAltName=IP:127.0.0.1 \
        -keyout "$WORK/key.pem" -out "$WORK/cert.pem" 2>/dev/null ;;
  *) echo "perf/tls.sh: KEY is ec or rsa" >&2; exit 1 ;;
esac
python3 - >"$WORK/body.json" <<'PY'
import json
text = " ".join(["the router keeps every prompt prefix on the engine that holds it"] * 28)
b = json.dumps({"model": "sim", "max_tokens": 4, "messages": [
    {"role": "user", "content": text}]}, separators=(",", ":"))
print(b[:2048] if len(b) > 2048 else b, end="")
PY
cat >"$WORK/post.lua" <<'LUA'
local f = assert(io.open(os.getenv("BODY_FILE"), "rb"))
wrk.method = "POST"
wrk.body = f:read("*a")
f:close()
wrk.headers["Content-Type"] = "application/json"
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('WRK %d %d %d %d %d\n', summary.requests, summary.duration,
    e.connect + e.read + e.write + e.status + e.timeout,
    latency:percentile(50), latency:percentile(99)))
end
LUA
EPORT=$(free_port)
"${PIN_LOAD[@]}" "$BIN" engine-sim --listen "127.0.0.1:$EPORT" --fixed-response \
  >"$WORK/engine.log" 2>&1 &
PIDS+=($!)
wait_port "$EPORT"

# === proxies ===
start_radixgate() { # PORT IO
  cat >"$WORK/rg-$2.toml" <<TOML
[server]
listen = "127.0.0.1:$1"
shards = 1
io = "$2"
[server.tls]
cert = "$WORK/cert.pem"
key = "$WORK/key.pem"
[routing]
policy = "round_robin"
[log]
level = "warn"
access = false
[[backends]]
id = "e0"
url = "http://127.0.0.1:$EPORT"
models = ["sim"]
TOML
  "${PIN_PROXY[@]}" "$BIN" serve --config "$WORK/rg-$2.toml" >"$WORK/rg-$2.log" 2>&1 &
  PROXY=$!
}
start_nginx() { # PORT
  local d=$WORK/nginx
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
  client_body_buffer_size 1m;
  keepalive_requests 10000000;
  keepalive_timeout 300s;
  upstream engines {
    server 127.0.0.1:$EPORT;
    keepalive 512;
  }
  server {
    listen 127.0.0.1:$1 ssl;
    ssl_certificate $WORK/cert.pem;
    ssl_certificate_key $WORK/key.pem;
    ssl_protocols TLSv1.2 TLSv1.3;
    ssl_session_cache off;
    ssl_session_tickets off;
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
  PROXY=$!
}

echo "| proxy | measurement | rate | p50 / p99 | proxy CPU µs per unit |"
echo "|---|---|---|---|---|"
measure() { # NAME PORT
  local name=$1 port=$2 t0 t1 out n
  wait_port "$port"
  # Warm up (both paths).
  "${PIN_LOAD[@]}" openssl s_time -connect "127.0.0.1:$port" -new -time 1 >/dev/null 2>&1 || true
  t0=$(cpu_ticks "$PROXY")
  out=$("${PIN_LOAD[@]}" openssl s_time -connect "127.0.0.1:$port" -new -www /health \
    -time "$DURATION" 2>&1 || true)
  t1=$(cpu_ticks "$PROXY")
  n=$(sed -n 's/^\([0-9]*\) connections in [0-9.]* real seconds.*/\1/p' <<<"$out" | tail -1)
  if [ -n "$n" ] && [ "$n" -gt 0 ]; then
    echo "| $name | new TLS connection + GET /health (openssl s_time -new) | $(awk -v n="$n" -v d="$DURATION" 'BEGIN{printf "%.0f handshakes/s", n/d}') | | $(awk -v t=$((t1 - t0)) -v n="$n" -v h="$CLK_TCK" 'BEGIN{printf "%.0f", t*1e6/h/n}') |"
  else
    log "$name: s_time gave no result: $(tail -c 300 <<<"$out")"
  fi
  for c in $CONCS; do
    t0=$(cpu_ticks "$PROXY")
    out=$(BODY_FILE=$WORK/body.json "${PIN_LOAD[@]}" wrk -t1 -c"$c" -d"${DURATION}s" \
      -s "$WORK/post.lua" "https://127.0.0.1:$port/v1/chat/completions" 2>&1 || true)
    t1=$(cpu_ticks "$PROXY")
    read -r _ reqs dur errs p50 p99 <<<"$(grep '^WRK ' <<<"$out" || echo "WRK 0 1 0 0 0")"
    if [ "$reqs" -gt 0 ]; then
      echo "| $name | kept-alive POST 2 KB, c=$c (wrk) | $(awk -v r="$reqs" -v d="$dur" 'BEGIN{printf "%.0f req/s", r/(d/1e6)}')$([ "$errs" = 0 ] || echo " ($errs errors)") | $p50 / $p99 µs | $(awk -v t=$((t1 - t0)) -v n="$reqs" -v h="$CLK_TCK" 'BEGIN{printf "%.1f", t*1e6/h/n}') |"
    else
      log "$name c=$c: wrk gave no result: $(tail -c 300 <<<"$out")"
    fi
  done
  stop_pids "$PROXY"
}

for io in epoll io_uring; do
  PORT=$(free_port)
  start_radixgate "$PORT" "$io"
  measure "radixgate 1 shard ($io)" "$PORT"
done
PORT=$(free_port)
start_nginx "$PORT"
measure "nginx $(nginx -v 2>&1 | sed 's|.*/||'), 1 worker" "$PORT"
log "done (key: $KEY, ${DURATION}s per row)"

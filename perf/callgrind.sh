#!/usr/bin/env bash
# Instructions per request, counted exactly with valgrind's callgrind: repeatable on
# a noisy shared VM with no hardware counters (where perf stat and timing are not).
#
#   perf/callgrind.sh [radixgate|nginx] [REQUESTS] [BODY_BYTES] [POLICY]
#                                   (defaults: radixgate 5000 2048 prefix_aware)
#   BIN=/tmp/radixgate-before TAG=before perf/callgrind.sh radixgate 2000
#                                   (a given binary, not this checkout; TAG names the dump)
#   EXTRA_TOML=$'[cluster]\nurl = "redis://127.0.0.1:6379"' TAG=cluster perf/callgrind.sh
#                                   (radixgate only: appended to the gateway's config)
#   ENGINE_DELAY_US=2000 ENGINE_BIN=target/release/radixgate BIN=… perf/callgrind.sh
#                                   (the engine waits 2 ms before each answer, so the
#                                   proxy always waits for it: see below)
#
# Starts one `radixgate engine-sim --fixed-response` natively and the proxy under
# callgrind (radixgate: 1 shard, epoll driver, as valgrind does not model io_uring;
# nginx: one process, master_process off), sends 200 warm-up requests and then
# REQUESTS sequential keep-alive POSTs, stops the proxy, and prints user-space
# instructions per request plus the top functions by inclusive and self cost.
# Kernel work (the TCP stack) is not counted. The output file stays in
# target/callgrind/ for callgrind_annotate or kcachegrind.
#
# With the engine answering at once (the default), whether the answer is already
# there when the proxy (slowed ~50x by valgrind) first reads decides how often the
# proxy parks in epoll_wait, and each park and re-poll costs ~1,400 instructions: one
# binary's total moves by ±1,000 between runs. The script prints the parks per
# request ("epoll_wait/request"); compare runs with similar values, or set
# ENGINE_DELAY_US (e.g. 2000: each answer waits 2 ms, as a real engine's would) so
# that every request waits on the upstream and runs repeat within a few instructions.
# ENGINE_BIN runs the engine from another binary (older ones lack --fixed-delay-us).
set -euo pipefail
cd "$(dirname "$0")/.."
PROXY=${1:-radixgate}
REQUESTS=${2:-5000}
BODY=${3:-2048}
POLICY=${4:-prefix_aware}
# BIN=path/to/radixgate measures that binary instead of building this checkout (for
# before/after comparisons: copy the "before" binary aside, then change the code).
if [ -z "${BIN:-}" ]; then
  cargo build --release -q -p radixgate
  BIN=$PWD/target/release/radixgate
fi
OUTDIR=$PWD/target/callgrind
mkdir -p "$OUTDIR"
WORK=$(mktemp -d /tmp/radixgate-callgrind.XXXXXX)
chmod 755 "$WORK"
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'; }

EPORT=$(free_port)
ENGINE_ARGS=(engine-sim --listen "127.0.0.1:$EPORT" --fixed-response)
[ "${ENGINE_DELAY_US:-0}" = 0 ] || ENGINE_ARGS+=(--fixed-delay-us "$ENGINE_DELAY_US")
"${ENGINE_BIN:-$BIN}" "${ENGINE_ARGS[@]}" >"$WORK/engine.log" 2>&1 &
PIDS+=($!)
PORT=$(free_port)
OUT=$OUTDIR/callgrind.$PROXY-$POLICY-$BODY${TAG:+-$TAG}.out
case $PROXY in
radixgate)
  cat >"$WORK/gw.toml" <<TOML
[server]
listen = "127.0.0.1:$PORT"
shards = 1
io = "epoll"
[routing]
policy = "$POLICY"
[log]
level = "warn"
access = false
[[backends]]
id = "e0"
url = "http://127.0.0.1:$EPORT"
models = ["sim"]
TOML
  [ -z "${EXTRA_TOML:-}" ] || printf '%s\n' "$EXTRA_TOML" >>"$WORK/gw.toml"
  valgrind --tool=callgrind --callgrind-out-file="$OUT" "$BIN" serve --config "$WORK/gw.toml" \
    >"$WORK/proxy.log" 2>&1 &
  ;;
nginx)
  { [ "$(id -u)" = 0 ] && echo "user $(id -un);"
    cat <<NGINX
daemon off;
master_process off;
worker_processes 1;
pid $WORK/nginx.pid;
error_log $WORK/error.log warn;
events { worker_connections 1024; }
http {
  access_log off;
  client_body_temp_path $WORK/body; proxy_temp_path $WORK/proxy; fastcgi_temp_path $WORK/fcgi;
  uwsgi_temp_path $WORK/uwsgi; scgi_temp_path $WORK/scgi;
  client_body_buffer_size 1m;
  keepalive_requests 10000000;
  upstream engines { server 127.0.0.1:$EPORT; keepalive 64; }
  server {
    listen 127.0.0.1:$PORT;
    location / { proxy_pass http://engines; proxy_http_version 1.1; proxy_set_header Connection ""; }
  }
}
NGINX
  } >"$WORK/nginx.conf"
  valgrind --tool=callgrind --callgrind-out-file="$OUT" nginx -p "$WORK" -c "$WORK/nginx.conf" \
    -e "$WORK/error.log" >"$WORK/proxy.log" 2>&1 &
  ;;
*) echo "unknown proxy $PROXY" >&2; exit 2 ;;
esac
VG=$!
PIDS+=($VG)

cat >"$WORK/client.py" <<'PY'
# client.py PORT N BODY_BYTES: N sequential keep-alive chat POSTs, each checked for 200.
import json, socket, sys, time
port, n, size = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
words = "the router keeps every prompt prefix on the engine that holds it ".split()
def make(k):
    text = " ".join(words[i % len(words)] for i in range(k))
    return json.dumps({"model": "sim", "max_tokens": 4, "messages": [
        {"role": "system", "content": text}, {"role": "user", "content": "Summarise."}]},
        separators=(",", ":"))
lo, hi = 1, 2
while len(make(hi)) <= size:
    lo, hi = hi, hi * 2
while lo + 1 < hi:  # the largest k whose body fits in `size`
    mid = (lo + hi) // 2
    lo, hi = (mid, hi) if len(make(mid)) <= size else (lo, mid)
body = make(lo)
req = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
       f"Content-Length: {len(body)}\r\n\r\n{body}").encode()
deadline = time.time() + 120
while True:
    try:
        s = socket.create_connection(("127.0.0.1", port))
        break
    except OSError:
        if time.time() > deadline:
            raise
        time.sleep(0.2)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
for _ in range(n):
    s.sendall(req)
    buf = b""
    while b"\r\n\r\n" not in buf:
        buf += s.recv(65536)
    head, rest = buf.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200"), head
    length = next(int(l.split(b":")[1]) for l in head.split(b"\r\n")
                  if l.lower().startswith(b"content-length"))
    while len(rest) < length:
        rest += s.recv(65536)
PY
python3 "$WORK/client.py" "$PORT" 200 "$BODY"
# Count only the measured requests: zero the counters after the warm-up.
callgrind_control -z "$VG" >/dev/null
python3 "$WORK/client.py" "$PORT" "$REQUESTS" "$BODY"
callgrind_control -d "$VG" >/dev/null
kill "$VG"
wait "$VG" 2>/dev/null || true
# The dump taken after the measured requests (callgrind_control -d) holds exactly them.
DUMP=$(ls -t "$OUT".* 2>/dev/null | head -1 || true)
[ -n "$DUMP" ] || DUMP=$OUT
TOTAL=$(callgrind_annotate "$DUMP" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",","",$1); print $1; exit}')
# Parks per request: how often the proxy waited in epoll_wait (see above).
PARKS=$(awk '
  /^c?fn=\(/ { id = $1; sub(/^c?fn=/, "", id); if (NF > 1) name[id] = $2 }
  /^cfn=/ { hit = (name[id] ~ /epoll_wait/) }
  /^calls=/ { if (hit) { split($1, c, "="); n += c[2] } hit = 0 }
  END { print n + 0 }' "$DUMP")
echo "$PROXY ($POLICY, $BODY B body): $TOTAL instructions for $REQUESTS requests = $((TOTAL / REQUESTS)) per request, epoll_wait/request $(awk -v p="$PARKS" -v r="$REQUESTS" 'BEGIN { printf "%.2f", p / r }') ($DUMP)"
echo "--- top inclusive"
callgrind_annotate --inclusive=yes "$DUMP" 2>/dev/null | sed -n '/file:function/,$p' | head -40
echo "--- top self"
callgrind_annotate "$DUMP" 2>/dev/null | sed -n '/file:function/,$p' | head -30

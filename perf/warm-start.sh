#!/usr/bin/env bash
# How long a new cluster replica takes to load its peers' index (issue 18's target:
# under 1 s with 100k indexed blocks).
#
#   perf/warm-start.sh [DOCS] [BLOCKS_PER_DOC] [ROUNDS]   (defaults: 1000 100 3)
#   BIN=path/to/radixgate perf/warm-start.sh            (a given binary)
#
# Starts a Redis bus (deploy/cluster/bus), four simulated engines and replica A
# (cluster mode, 1 shard), sends DOCS distinct documents of BLOCKS_PER_DOC blocks
# (64-byte blocks) through A so that its index holds about DOCS x BLOCKS_PER_DOC
# blocks, then ROUNDS times starts replica B and measures:
#   - warm ms: B's own account, from subscribing to having loaded A's snapshot
#     (its log line "cluster: warm from a peer's snapshot");
#   - ready ms: from spawning B's process to B's /ready answering 200 (includes
#     process start and the roll call);
#   - the blocks in B's index once ready, against A's.
# Every process is stopped by its PID on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
DOCS=${1:-1000}
BLOCKS=${2:-100}
ROUNDS=${3:-3}
if [ -z "${BIN:-}" ]; then
  cargo build --release -q -p radixgate
  BIN=$PWD/target/release/radixgate
fi
WORK=$(mktemp -d /tmp/radixgate-warm.XXXXXX)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'; }
wait_port() { for _ in $(seq 1 3000); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.01; done; echo "port $1 never opened" >&2; exit 1; }

BUS_PORT=$(free_port)
deploy/cluster/bus "$BUS_PORT" >"$WORK/bus.log" 2>&1 &
PIDS+=($!)
wait_port "$BUS_PORT"
BACKENDS=""
for i in 0 1 2 3; do
  P=$(free_port)
  "$BIN" engine-sim --listen "127.0.0.1:$P" --fixed-response --cache-blocks 60000 >"$WORK/engine$i.log" 2>&1 &
  PIDS+=($!)
  BACKENDS+=$'\n'"[[backends]]"$'\n'"id = \"e$i\""$'\n'"url = \"http://127.0.0.1:$P\""$'\n'"models = [\"sim\"]"$'\n'"cache_blocks = 60000"
done
config() { # config NAME PORT
  cat >"$WORK/$1.toml" <<TOML
[server]
listen = "127.0.0.1:$2"
shards = 1
io = "epoll"
[routing]
policy = "prefix_aware"
[log]
level = "info"
access = false
[cluster]
url = "redis://127.0.0.1:$BUS_PORT"
channel = "warm-$$"
node = "$1"
warm_timeout_ms = 30000
$BACKENDS
TOML
}
A_PORT=$(free_port)
config a "$A_PORT"
"$BIN" serve --config "$WORK/a.toml" >"$WORK/a.log" 2>&1 &
PIDS+=($!)
wait_port "$A_PORT"

python3 - "$A_PORT" "$DOCS" "$BLOCKS" <<'PY'
# Sends DOCS distinct documents of BLOCKS 64-byte blocks each through replica A.
import json, socket, sys
port, docs, blocks = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
s = socket.create_connection(("127.0.0.1", port))
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
for d in range(docs):
    text = "".join(f"doc {d:06d} block {b:06d} " + "x" * 40 for b in range(blocks))
    body = json.dumps({"model": "sim", "max_tokens": 1,
                       "messages": [{"role": "user", "content": text}]})
    s.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
               f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
    buf = b""
    while b"\r\n\r\n" not in buf:
        buf += s.recv(65536)
    head, rest = buf.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200"), head
    n = next(int(l.split(b":")[1]) for l in head.split(b"\r\n") if l.lower().startswith(b"content-length"))
    while len(rest) < n:
        rest += s.recv(65536)
PY

blocks_of() { curl -s "http://127.0.0.1:$1/metrics" | awk '/^radixgate_index_blocks\{copy="coordinator"\}/ {print $2}'; }
A_BLOCKS=$(blocks_of "$A_PORT")
echo "replica A holds $A_BLOCKS blocks ($DOCS documents x $BLOCKS blocks); load $(cut -d' ' -f1-3 /proc/loadavg)"
echo
echo "| round | blocks in A | blocks in B when ready | snapshot ops | warm ms (B's log) | spawn to /ready ms |"
echo "|---|---|---|---|---|---|"
for r in $(seq 1 "$ROUNDS"); do
  B_PORT=$(free_port)
  config "b$r" "$B_PORT"
  T0=$(date +%s%N)
  "$BIN" serve --config "$WORK/b$r.toml" >"$WORK/b$r.log" 2>&1 &
  B=$!
  PIDS+=($B)
  until [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$B_PORT/ready" 2>/dev/null)" = 200 ]; do sleep 0.005; done
  T1=$(date +%s%N)
  B_BLOCKS=$(blocks_of "$B_PORT")
  LINE=$(sed 's/\x1b\[[0-9;]*m//g' "$WORK/b$r.log" | grep "warm from a peer" | tail -1)
  OPS=$(sed -n 's/.*ops=\([0-9]*\).*/\1/p' <<<"$LINE")
  MS=$(sed -n 's/.* ms=\([0-9]*\).*/\1/p' <<<"$LINE")
  echo "| $r | $A_BLOCKS | $B_BLOCKS | ${OPS:-?} | ${MS:-?} | $(( (T1 - T0) / 1000000 )) |"
  kill "$B"; wait "$B" 2>/dev/null || true
done

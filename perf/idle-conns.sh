#!/usr/bin/env bash
# Memory per idle keep-alive client connection, and what is given back once they
# close.
#
#   perf/idle-conns.sh [CONNECTIONS] [ROUNDS]      (defaults: 10000 1)
#   BIN=path/to/radixgate perf/idle-conns.sh ...   (a given binary, e.g. an older build)
#   EXTRA_TOML='client_park_after_ms = 600000' ... (more `[server]` keys)
#
# Starts one `radixgate engine-sim` and `radixgate serve` (2 shards) on free
# loopback ports. Each round opens CONNECTIONS keep-alive connections, sends one chat
# completion on each (so each has used its buffers) and keeps them open; waits 3 s
# (past `server.client_park_after_ms`, 1 s by default); reads the gateway's RSS;
# closes them all; waits 3 s (a shard returns free memory within a second or two
# of a burst ending) and reads the RSS again. Prints one Markdown row per round.
# Every process is stopped by its PID on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
CONNS=${1:-10000}
ROUNDS=${2:-1}
if [ -z "${BIN:-}" ]; then
  cargo build --release -q -p radixgate
  BIN=$PWD/target/release/radixgate
fi
# Each process needs CONNECTIONS descriptors and some; raise the soft limit as far as
# the hard one allows.
WANT=$((CONNS + 1024))
HARD=$(ulimit -Hn)
[ "$HARD" = unlimited ] || [ "$HARD" -ge "$WANT" ] || { echo "open files: hard limit $HARD < $WANT" >&2; exit 1; }
ulimit -n "$WANT"
WORK=$(mktemp -d /tmp/radixgate-idle.XXXXXX)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'; }
wait_port() { for _ in $(seq 1 3000); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.01; done; echo "port $1 never opened" >&2; exit 1; }

ENGINE_PORT=$(free_port)
"$BIN" engine-sim --listen "127.0.0.1:$ENGINE_PORT" --prefill-us-per-token 0 \
  --decode-us-per-token 0 --default-max-tokens 4 --max-batch 256 \
  >"$WORK/engine.log" 2>&1 &
PIDS+=($!)
GW_PORT=$(free_port)
cat >"$WORK/gw.toml" <<TOML
[server]
listen = "127.0.0.1:$GW_PORT"
shards = 2
max_connections = $((CONNS + 100))
${EXTRA_TOML:-}

[[backends]]
id = "e0"
url = "http://127.0.0.1:$ENGINE_PORT"
models = ["sim"]
TOML
"$BIN" serve --config "$WORK/gw.toml" >"$WORK/gw.log" 2>&1 &
GW_PID=$!
PIDS+=("$GW_PID")
wait_port "$ENGINE_PORT"
wait_port "$GW_PORT"

python3 - "$GW_PORT" "$CONNS" "$ROUNDS" "$GW_PID" <<'PY'
import socket, sys, time

port, conns, rounds, pid = (int(a) for a in sys.argv[1:5])
body = b'{"model":"sim","max_tokens":4,"messages":[{"role":"user","content":"' + b"idle connection " * 64 + b'"}]}'
request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: "
           + str(len(body)).encode() + b"\r\n\r\n" + body)

def rss_kib():
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])

def answer(s):
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            raise RuntimeError("closed before the answer")
        data += chunk
    head, rest = data.split(b"\r\n\r\n", 1)
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(head.decode(errors="replace"))
    length = next(int(l.split(b":")[1]) for l in head.split(b"\r\n") if l.lower().startswith(b"content-length:"))
    while len(rest) < length:
        rest += s.recv(65536)

def warm():
    s = socket.create_connection(("127.0.0.1", port))
    for _ in range(200):
        s.sendall(request)
        answer(s)
    s.close()

warm()
time.sleep(1)
print("| round | connections | RSS before (MiB) | RSS with them idle (MiB) | KiB per idle connection | RSS after they closed (MiB) |")
print("|---|---|---|---|---|---|")
for r in range(1, rounds + 1):
    before = rss_kib()
    held = []
    for _ in range(conns):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(request)
        answer(s)
        held.append(s)
    time.sleep(3)
    idle = rss_kib()
    for s in held:
        s.close()
    held = []
    time.sleep(3)
    after = rss_kib()
    print(f"| {r} | {conns} | {before / 1024:.1f} | {idle / 1024:.1f} | {(idle - before) / conns:.2f} | {after / 1024:.1f} |")
PY

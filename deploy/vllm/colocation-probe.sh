#!/usr/bin/env bash
#! Measures what two vLLM CPU engines pinned to one core cost each other.
#!
#!   deploy/vllm/colocation-probe.sh [REQUESTS] [SIZE]      (defaults: 60 small)
#!   deploy/vllm/colocation-probe.sh burst [ROUNDS] [SIZE]   (defaults: 3 small)
#!
#! Starts two engines on core 0 (fleet.sh, 40 KV blocks each, ports 18700-18701;
#! PROBE_CORES="0 1" puts them on a core each instead). fleet.sh runs engines that
#! share a core in one process each; RADIXGATE_VLLM_INPROC=0 measures vLLM's default
#! process layout (a model worker that busy-polls beside each engine) instead.
#!
#! Default mode: sends REQUESTS streaming chat requests that alternate between them,
#! each engine cycling over three documents of its own (cached after the first round),
#! and prints each request's time to first token and, per engine, the median over the
#! cached rounds. vLLM's CPU worker busy-polls its shared-memory queue for a second
#! after each step, so the engine whose neighbour has just answered waits for that.
#!
#! burst mode: both engines are warmed with one request each, then each round sends
#! three fresh prompts (about 1,000 tokens) to both engines at the same moment and
#! prints every request's time to first token per engine. Engines that shared the
#! core fairly would each answer about half as fast as alone; what it shows instead is
#! one engine answering at its solo speed while the other waits until it is idle.
#!
#! Stops both engines by PID on exit. See docs/real-vllm.md ("Where the slow
#! requests come from").
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
mode=alternate
if [ "${1:-}" = burst ]; then
    mode=burst
    shift
fi
requests="${1:-60}"
[ "$mode" = burst ] && requests="${1:-3}"
size="${2:-small}"
state="$(mktemp -d /tmp/radixgate-colocation.XXXXXX)"
trap '"$here/fleet.sh" stop "$state" >/dev/null 2>&1 || true; rm -rf "$state"' EXIT
RADIXGATE_VLLM_CORES="${PROBE_CORES:-0 0}" "$here/fleet.sh" start "$state" 2 18700 "$size" \
    -- --num-gpu-blocks-override 40 >/dev/null
if [ "$mode" = burst ]; then
    python3 - "$requests" "$size" <<'PY'
import http.client, json, random, sys, threading, time

rounds, model = int(sys.argv[1]), sys.argv[2]


def ttft(port, seed, words):
    rng = random.Random(seed)
    text = " ".join("".join(rng.choice("abcdefghij") for _ in range(6)) for _ in range(words))
    body = json.dumps({
        "model": model, "max_tokens": 8, "ignore_eos": True, "stream": True,
        "messages": [{"role": "system", "content": text},
                     {"role": "user", "content": "summarise"}],
    })
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    start = time.monotonic()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    first = None
    for line in conn.getresponse():
        if first is None and line.startswith(b"data:"):
            first = (time.monotonic() - start) * 1000
    conn.close()
    return first


for engine in (0, 1):  # warm-up, one at a time
    ttft(18700 + engine, 10_000 + engine, 50)
for r in range(rounds):
    results = {0: [], 1: []}

    def one(engine, i):
        results[engine].append(round(ttft(18700 + engine, r * 100 + engine * 10 + i, 200)))

    threads = [threading.Thread(target=one, args=(e, i)) for e in (0, 1) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for engine in (0, 1):
        print(f"round {r} engine {engine} ttft_ms {sorted(results[engine])}", flush=True)
PY
    exit 0
fi
python3 - "$requests" "$size" <<'PY'
import http.client, json, random, statistics, sys, time

requests, model = int(sys.argv[1]), sys.argv[2]
docs = []
for d in range(6):
    rng = random.Random(d)
    words = ("".join(rng.choice("abcdefghij") for _ in range(6)) for _ in range(300))
    docs.append(" ".join(words))
ttft = {0: [], 1: []}
for i in range(requests):
    engine = i % 2
    doc = docs[engine * 3 + (i // 2) % 3]
    body = json.dumps({
        "model": model, "max_tokens": 8, "ignore_eos": True, "stream": True,
        "messages": [{"role": "system", "content": doc},
                     {"role": "user", "content": f"question {i} about things"}],
    })
    conn = http.client.HTTPConnection("127.0.0.1", 18700 + engine, timeout=120)
    start = time.monotonic()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response, first = conn.getresponse(), None
    for line in response:
        if first is None and line.startswith(b"data:"):
            first = (time.monotonic() - start) * 1000
    conn.close()
    print(f"request {i} engine {engine} ttft_ms {first:.0f}", flush=True)
    if i >= 6:  # each engine's three documents are cached from the second round on
        ttft[engine].append(first)
for engine, times in ttft.items():
    if times:
        print(f"engine {engine}: median ttft {statistics.median(times):.0f} ms over {len(times)} cached requests")
PY

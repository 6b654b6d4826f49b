#!/usr/bin/env python3
"""Renders perf/compare.sh's raw rows (results.jsonl) as perf/RESULTS.md.

Every figure is the median over rounds; ratios are against nginx measured in the
same run, added latency against the direct (no proxy) row of the same body size.
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x, digits=0, suffix=""):
    if x is None:
        return "–"
    return f"{x:,.{digits}f}{suffix}"


def ratio(a, b):
    return f"{a / b:.2f}×" if a is not None and b else "–"


def main():
    ap = argparse.ArgumentParser()
    for a in ("raw", "oha", "proxies", "out", "command", "duration", "rounds", "proxy-core",
              "load-core", "nice", "load-start", "load-end", "elapsed"):
        ap.add_argument("--" + a, default="")
    args = ap.parse_args()

    rows = [json.loads(l) for l in open(args.raw) if l.strip()]
    oha = [json.loads(l) for l in open(args.oha) if l.strip()] if os.path.exists(args.oha) else []
    proxies = [l.rstrip("\n").split("|", 1) for l in open(args.proxies) if l.strip()]
    order = [p[0] for p in proxies]
    bodies = sorted({r["body"] for r in rows})
    concs = sorted({r["conc"] for r in rows})

    cell = {}
    for r in rows:
        cell.setdefault((r["proxy"], r["body"], r["conc"]), []).append(r)

    def stat(p, b, c, key):
        rs = cell.get((p, b, c), [])
        if key == "errors":
            return sum(r["errors"] for r in rs) if rs else None
        return median(r.get(key) for r in rs if r["requests"])

    git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True).stdout.strip()
    commit = git("rev-parse", "--short", "HEAD")
    dirty = " (with uncommitted changes)" if git("status", "--porcelain", "--", "src", "orchestrator", "Cargo.toml", "Cargo.lock") else ""
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    out = []
    w = out.append
    w("# perf: radixgate against nginx, HAProxy, SGLang's and vLLM's routers\n")
    w(f"- date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}, commit `{commit}`{dirty}")
    w(f"- machine: {cpu}, {os.cpu_count()} cores (nproc), Linux {platform.release()}")
    w(f"- load average at start / end: {args.load_start} / {args.load_end} "
      f"(the machine is shared with other engineers' builds: absolute numbers are noisy, "
      f"which is why every proxy is measured side by side in one run and reported as "
      f"ratios to nginx)")
    w(f"- reproduce: `{args.command}` ({args.elapsed} s; {args.duration} s of wrk per cell, "
      f"{args.rounds} round(s), medians over rounds)")
    w(f"- core placement: proxy under test alone on core {args.proxy_core} "
      f"(`taskset -c {args.proxy_core}` on the whole process: every thread, so radixgate's 2 "
      f"shards and its coordinator share that core); wrk (`-t1`) and "
      f"both engines on core {args.load_core}; everything the harness starts runs at nice "
      f"{args.nice}, so that other jobs on the machine take less of these cores")
    w("- engines: 2 × `radixgate engine-sim --fixed-response` (answers every completion at "
      "once with a constant 240-byte chat completion, without parsing); every proxy balances "
      "over both")
    w("- load: `wrk -t1 -cC -d{D}s -s post.lua` POSTing one fixed chat body (`model`, "
      "`max_tokens`, a system and a user message) of exactly the given size to "
      "`/v1/chat/completions`; the same body every request, so cache-aware policies see a "
      "full prefix match every time")
    w("- CPU µs/req: utime+stime of the proxy's processes (all threads, children included) "
      "from `/proc/PID/stat` across the wrk run, divided by completed requests; includes the "
      "kernel's TCP work charged to the proxy. `engine µs/req`: the same for both engines.")
    w("- added p50: the proxy's p50 minus the direct p50 at the same body size and concurrency. "
      "Latency percentiles are wrk's, which corrects for coordinated omission (it adds "
      "synthetic samples for stalls), so p99 on a busy machine reflects scheduler stalls "
      "more than the proxy; p50 is the figure to compare.")
    w("- radixgate runs with its defaults (health checks, `/metrics` scraping, retries, "
      "breakers) except `log.access = false` and `log.level = \"warn\"`; the peers run with "
      "per-request logging off too.\n")

    w("## Proxies\n")
    for name, desc in proxies:
        w(f"- `{name}`: {desc}")
    w("")

    # Headline: 2 KB (smallest body) at concurrency 64 (or the middle one).
    hb = bodies[0] if bodies else None
    hc = 64 if 64 in concs else (concs[len(concs) // 2] if concs else None)
    if hb is not None:
        w(f"## Headline: {hb} B body, concurrency {hc}, and added latency at concurrency 1\n")
        w("| proxy | req/s | req/s × nginx | CPU µs/req | CPU × nginx | "
          + " | ".join(f"added p50 @c=1, {b} B" for b in bodies) + " |")
        w("|---|--:|--:|--:|--:|" + "--:|" * len(bodies))
        nr = stat("nginx", hb, hc, "rps")
        nc = stat("nginx", hb, hc, "cpu_us_per_req")
        for p in order:
            rps = stat(p, hb, hc, "rps")
            c = stat(p, hb, hc, "cpu_us_per_req")
            added = []
            for b in bodies:
                d = stat("direct", b, 1, "p50_us")
                x = stat(p, b, 1, "p50_us")
                added.append(fmt(x - d, 0, " µs") if x is not None and d is not None and p != "direct" else "–")
            w(f"| {p} | {fmt(rps)} | {ratio(rps, nr)} | {fmt(c, 1)} | {ratio(c, nc)} | "
              + " | ".join(added) + " |")
        w("")

    # Long prompts: request-body throughput through each proxy against direct.
    if bodies:
        w("## Request body throughput (MB/s of chat bodies; × direct at the same body and concurrency)\n")
        w("MB/s = req/s × body bytes / 10⁶: the prompt bytes each proxy moves to the engines. "
          "At 128 KB the proxies' body handling (buffering, copies, JSON parsing) dominates.\n")
        w("| proxy | " + " | ".join(f"{b} B @c={c}" for b in bodies for c in concs) + " |")
        w("|---|" + "--:|" * (len(bodies) * len(concs)))
        for p in order:
            cells = []
            for b in bodies:
                for c in concs:
                    rps = stat(p, b, c, "rps")
                    d = stat("direct", b, c, "rps")
                    if rps is None:
                        cells.append("–")
                    else:
                        mbs = rps * b / 1e6
                        cells.append(f"{mbs:,.0f}" + (f" ({rps / d:.2f}×)" if d and p != "direct" else ""))
            w(f"| {p} | " + " | ".join(cells) + " |")
        w("")

    for b in bodies:
        for c in concs:
            w(f"## {b} B body, concurrency {c}\n")
            w("| proxy | req/s | × nginx | p50 µs | p99 µs | added p50 µs | CPU µs/req | CPU × nginx | engine µs/req | errors |")
            w("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
            nr = stat("nginx", b, c, "rps")
            nc = stat("nginx", b, c, "cpu_us_per_req")
            d50 = stat("direct", b, c, "p50_us")
            for p in order:
                if (p, b, c) not in cell:
                    w(f"| {p} | not measured | | | | | | | | |")
                    continue
                rps = stat(p, b, c, "rps")
                p50 = stat(p, b, c, "p50_us")
                cpu_r = stat(p, b, c, "cpu_us_per_req")
                added = fmt(p50 - d50, 0) if p50 is not None and d50 is not None and p != "direct" else "–"
                w(f"| {p} | {fmt(rps)} | {ratio(rps, nr)} | {fmt(p50)} | {fmt(stat(p, b, c, 'p99_us'))} | "
                  f"{added} | {fmt(cpu_r, 1)} | {ratio(cpu_r, nc)} | "
                  f"{fmt(stat(p, b, c, 'engine_cpu_us_per_req'), 1)} | {stat(p, b, c, 'errors')} |")
            w("")

    if oha:
        w("## oha latency at concurrency 1\n")
        w("| proxy | body | p50 µs | p99 µs | p99.9 µs |")
        w("|---|--:|--:|--:|--:|")
        for p in order:
            for b in bodies:
                rs = [o for o in oha if o["proxy"] == p and o["body"] == b]
                if rs:
                    w(f"| {p} | {b} | {fmt(median(o['p50_us'] for o in rs))} | "
                      f"{fmt(median(o['p99_us'] for o in rs))} | {fmt(median(o['p999_us'] for o in rs))} |")
        w("")

    notes = args.out.replace("RESULTS.md", "RESULTS-notes.md")
    if os.path.exists(notes):
        w(open(notes).read())
    open(args.out, "w").write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()

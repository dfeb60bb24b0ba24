#!/usr/bin/env bash
# Arize Phoenix, an OTLP trace backend with a UI, in its own venv (.cache/phoenix), on 127.0.0.1.
#
#   scripts/phoenix.sh          install on first use, then serve: UI http://127.0.0.1:6006, OTLP gRPC :4317
#
# Then, in the shell that starts the services: export OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317
# Phoenix's dependencies never touch .venv. PHOENIX_VERSION pins the version (default below).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.cache/phoenix"
VERSION="${PHOENIX_VERSION:-}"
if [[ ! -x "$VENV/bin/phoenix" ]]; then
  "${PYTHON_SYS:-python3}" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q "arize-phoenix${VERSION:+==$VERSION}"
fi
export PHOENIX_HOST="${PHOENIX_HOST:-127.0.0.1}" PHOENIX_PORT="${PHOENIX_PORT:-6006}"
export PHOENIX_GRPC_PORT="${PHOENIX_GRPC_PORT:-4317}" PHOENIX_WORKING_DIR="${PHOENIX_WORKING_DIR:-$VENV/data}"
exec "$VENV/bin/phoenix" serve

#!/usr/bin/env bash
# Fail if the committed shared/proto_gen/ is not exactly what scripts/proto.sh generates from protos/.
# Regenerates into a temporary directory and diffs; never touches shared/proto_gen/.
# Python: ${PYTHON:-.venv/bin/python} (passed through to proto.sh).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

COMMITTED="shared/proto_gen"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

if ! scripts/proto.sh --out "$TMP/proto_gen" >/dev/null; then
  echo "check_proto_fresh: code generation failed (see above)" >&2
  exit 1
fi

if [[ ! -d "$COMMITTED" ]]; then
  echo "check_proto_fresh: $COMMITTED/ is missing. Run scripts/proto.sh (make proto) and commit the result." >&2
  exit 1
fi

if ! diff -ru -x __pycache__ "$COMMITTED" "$TMP/proto_gen" >"$TMP/diff.txt"; then
  echo "check_proto_fresh: $COMMITTED/ is STALE: it differs from what scripts/proto.sh generates from protos/." >&2
  echo "check_proto_fresh: run scripts/proto.sh (make proto) and commit the result." >&2
  echo "check_proto_fresh: (a difference only in the 'Protobuf Python Version' header means a different" >&2
  echo "check_proto_fresh:  grpcio-tools than the pinned one; install the pinned version first.)" >&2
  echo "--- diff (committed vs regenerated), first 60 lines:" >&2
  head -n 60 "$TMP/diff.txt" >&2
  exit 1
fi
echo "check_proto_fresh: $COMMITTED/ is up to date"

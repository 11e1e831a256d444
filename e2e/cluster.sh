#!/usr/bin/env bash
# Run the e2e control plane by hand: build (or find in the cache) the binaries, then start etcd,
# kube-apiserver, kube-controller-manager, kube-scheduler and kwok on loopback until Ctrl-C.
#
#   bash e2e/cluster.sh            # prints: export KUBECONFIG=/tmp/baton-e2e-.../kubeconfig.yaml
#   bash e2e/cluster.sh --keep     # keep logs and certificates after Ctrl-C
#
# The tests (tests/e2e) start their own; this is for poking at one. Everything lives in
# tests/support/baton_testing/kube/controlplane.py (test support, not in the package); arguments after
# the script name go to it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
BIN="$(bash e2e/build.sh)"
KUBECTL="$(dirname "$PY")/kubectl"
[[ -x "$KUBECTL" ]] || KUBECTL="$(command -v kubectl)"
export PYTHONPATH="$PWD/tests/support${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m baton_testing.kube.controlplane --bin-dir "$BIN" --kubectl "$KUBECTL" "$@"

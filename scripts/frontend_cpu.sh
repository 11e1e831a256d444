#!/usr/bin/env bash
# CPU seconds per streamed token in each process of one engine (HTTP server + tokenizer manager,
# scheduler, detokenizer), read from /proc/<pid>/stat around one `baton bench serving` run.
# CPU time, not wall time, so it holds up on a noisy shared machine. From the repository root:
#
#   bash scripts/frontend_cpu.sh            # NUM=64 OUT=512 by default; ENGINE_ARGS adds serve flags
#   SPY=1 bash scripts/frontend_cpu.sh      # also a py-spy profile of the HTTP process, to ./spy.txt
#                                           # (py-spy is no dependency: .venv/bin/pip install py-spy first)
set -euo pipefail
if [ -n "${SPY:-}" ] && [ ! -x .venv/bin/py-spy ]; then
    echo "SPY=1 needs py-spy: .venv/bin/pip install py-spy" >&2
    exit 2
fi
MODEL=${MODEL:-/tmp/baton-tiny-h64}
PORT=${PORT:-$(.venv/bin/python -c "from baton.engine.utils.process import free_port; print(free_port())")}
NUM=${NUM:-64} OUT=${OUT:-512}
WORK=$(mktemp -d)
[ -f "$MODEL/config.json" ] || PYTHONPATH=tests/engine .venv/bin/python -c "from tiny_models import make_tiny_model; make_tiny_model('llama', '$MODEL', hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)" >/dev/null 2>&1
# shellcheck disable=SC2086
.venv/bin/baton serve --model-path "$MODEL" --host 127.0.0.1 --port "$PORT" --max-total-tokens 100000 \
    --log-level warning ${ENGINE_ARGS:-} >"$WORK/serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null; rm -rf "$WORK"' EXIT
for _ in $(seq 300); do curl -sf "localhost:$PORT/health" >/dev/null && break; sleep 0.5; done
snapshot() { for p in $SERVER $(pgrep -P $SERVER); do echo "$p $(awk '{print $14+$15}' /proc/$p/stat) $(tr '\0' ' ' </proc/$p/cmdline | cut -c1-60 | tr ' ' '_')"; done; }
bench() { .venv/bin/baton bench serving --base-url "http://127.0.0.1:$PORT" --tokenizer "$MODEL" "$@"; }
bench --num-prompts 8 --concurrency 8 --input-len 64 --output-len 16 >/dev/null  # warm-up
snapshot >"$WORK/cpu0"
if [ -n "${SPY:-}" ]; then .venv/bin/py-spy record -r 200 -d "${SPY_S:-14}" -f raw -o spy.txt -p $SERVER >/dev/null 2>&1 & fi
bench --num-prompts "$NUM" --concurrency "$NUM" --input-len 128 --output-len "$OUT" | grep -E "output tok/s|itl|duration"
snapshot >"$WORK/cpu1"
.venv/bin/python - "$WORK" $((NUM * OUT)) <<'PY'
import sys
work, tokens = sys.argv[1], int(sys.argv[2])
read = lambda f: {l.split()[0]: (int(l.split()[1]), l.split()[2]) for l in open(f) if l.strip()}
before, after = read(f"{work}/cpu0"), read(f"{work}/cpu1")
for pid, (ticks, name) in after.items():
    cpu = (ticks - before.get(pid, (ticks,))[0]) / 100
    print(f"{pid:>7} {cpu:6.2f} s {cpu * 1e6 / tokens:7.1f} us/token  {name}")
PY

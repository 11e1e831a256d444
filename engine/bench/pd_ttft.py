"""`baton bench pd-ttft`: the TTFT a client sees through PD (router + prefill + decode, KV over
Mooncake) against one colocated engine, same prompts, same run.

    baton bench pd-ttft --model-path DIR [--prompt-lens 1024,3072] [--num-prompts 8] [--output-len 8]

Requests go one at a time (concurrency 1), so TTFT is prefill + transfer + the first decode step,
without queueing. The PD path includes the router's hop.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Iterator

from baton.engine.bench.client import resolve_model_name, run_serving_benchmark
from baton.engine.bench.launcher import EngineProcess, engine_command, free_port
from baton.engine.bench.workload import WorkloadConfig, build_workload

STARTUP_TIMEOUT_S = 600.0


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-path", required=True)
    p.add_argument("--prompt-lens", default="1024,3072", help="comma list of prompt lengths (tokens)")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--protocol", default="tcp", choices=("tcp", "rdma"))
    p.add_argument("--engine-args", default="", help="flags added to every engine")
    p.add_argument("--json-out", default=None)


@contextlib.contextmanager
def colocated(model_path: str, extra: list[str]) -> Iterator[str]:
    port = free_port()
    with EngineProcess(engine_command(model_path, port, extra), port) as engine:
        engine.wait_healthy(STARTUP_TIMEOUT_S, "colocated engine starting")
        yield engine.base_url


@contextlib.contextmanager
def pd_stack(model_path: str, protocol: str, extra: list[str]) -> Iterator[str]:
    bootstrap, pp, dp, rp = free_port(), free_port(), free_port(), free_port()
    pd = ["--disaggregation-protocol", protocol, *extra]
    prefill = EngineProcess(engine_command(model_path, pp, ["--disaggregation-mode", "prefill",
                                                            "--disaggregation-bootstrap-port", str(bootstrap), *pd]), pp)
    decode = EngineProcess(engine_command(model_path, dp, ["--disaggregation-mode", "decode", *pd]), dp)
    router = EngineProcess([sys.executable, "-m", "baton", "router", "--host", "127.0.0.1", "--port", str(rp),
                            "--pd-disaggregation", "--prefill", prefill.base_url, str(bootstrap),
                            "--decode", decode.base_url], rp)
    with prefill, decode:
        prefill.wait_healthy(STARTUP_TIMEOUT_S, "prefill engine starting")
        decode.wait_healthy(STARTUP_TIMEOUT_S, "decode engine starting")
        with router:
            router.wait_healthy(120, "router starting")
            yield router.base_url


def measure(base_url: str, tokenizer, lens: list[int], num_prompts: int, output_len: int) -> dict[int, dict]:
    """TTFT per prompt length, after an untimed pass over other prompts of the same lengths: the first
    requests an engine sees pay one-time costs (first touch of KV pages, new kernel shapes) that PD's
    engines partly pay at start when Mooncake registers their buffers."""
    model = resolve_model_name(base_url)
    out = {}
    for n in lens:
        warm = build_workload(tokenizer, WorkloadConfig(num_prompts=num_prompts, input_len=n, output_len=2, seed=n + 1))
        run_serving_benchmark(base_url, model, warm, concurrency=num_prompts)
    for n in lens:
        prompts = build_workload(tokenizer, WorkloadConfig(num_prompts=num_prompts, input_len=n, output_len=output_len, seed=n))
        out[n] = run_serving_benchmark(base_url, model, prompts, concurrency=1)["ttft"]
    return out


def run_cli(args: argparse.Namespace) -> int:
    import json
    import shlex

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    lens = [int(x) for x in args.prompt_lens.split(",")]
    extra = shlex.split(args.engine_args)
    with colocated(args.model_path, extra) as url:
        base = measure(url, tokenizer, lens, args.num_prompts, args.output_len)
    with pd_stack(args.model_path, args.protocol, extra) as url:
        pd = measure(url, tokenizer, lens, args.num_prompts, args.output_len)
    print(f"== TTFT, PD ({args.protocol}, via baton router) vs colocated; {args.num_prompts} requests per length, one at a time ==")
    print(f"{'prompt':>7} {'coloc p50':>10} {'PD p50':>9} {'added p50':>10} {'coloc mean':>11} {'PD mean':>9} {'added mean':>11}")
    for n in lens:
        c, p = base[n], pd[n]
        print(f"{n:>7} {c['p50_ms']:>8.1f}ms {p['p50_ms']:>7.1f}ms {p['p50_ms'] - c['p50_ms']:>8.1f}ms "
              f"{c['mean_ms']:>9.1f}ms {p['mean_ms']:>7.1f}ms {p['mean_ms'] - c['mean_ms']:>9.1f}ms")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"colocated": base, "pd": pd}, f, indent=2)
    return 0

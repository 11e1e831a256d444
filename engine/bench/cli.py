"""`baton bench serving|hf|compare|step|kv-transfer|pd-ttft`.

    baton bench serving --base-url http://127.0.0.1:30000 --tokenizer DIR --num-prompts 64 --concurrency 8
    baton bench hf --model-path DIR --mode batched --num-prompts 16
    baton bench compare --model-path DIR --variant radix: --variant noradix:--disable-radix-cache \\
        --shared-prefix-len 96 --input-len 128
    baton bench compare --model-path VL_DIR --images-per-request 1 --image-size 448x448 --image-reuse shared \\
        --variant cache: --variant "nocache:--mm-embedding-cache-mb 0"

Flag values that start with `--` must be attached with `=`: `--engine-args=--dtype float32`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex

from baton.engine.bench.workload import add_workload_args, build_workload, workload_config_from_args


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", required=True)
    _add_serving_args(sub.add_parser("serving", help="stream a random-token workload (with pictures: --images-per-request) to an OpenAI endpoint"))
    _add_hf_args(sub.add_parser("hf", help="HF transformers generate() on the same workload"))
    _add_compare_args(sub.add_parser("compare", help="engine variants vs HF baselines, one run"))
    from baton.engine.bench import kv_transfer, pd_ttft, step

    step.add_cli_args(sub.add_parser("step", help="GPU decode step and prefill of a real model shape vs the "
                                                  "memory-bandwidth and matmul limits measured in the same run"))
    kv_transfer.add_cli_args(sub.add_parser("kv-transfer", help="our per-request KV transfer vs Mooncake's raw write"))
    pd_ttft.add_cli_args(sub.add_parser("pd-ttft", help="TTFT through router + prefill + decode vs colocated"))


def _add_common(p: argparse.ArgumentParser) -> None:
    add_workload_args(p)
    p.add_argument("--json-out", default=None, help="also write the results dict here")


def _add_serving_args(p: argparse.ArgumentParser) -> None:
    _add_common(p)
    p.add_argument("--base-url", required=True)
    p.add_argument("--model", default=None, help="model name to send (default: first of /v1/models)")
    p.add_argument("--tokenizer", required=True, help="tokenizer directory used to build the prompts")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--api-key", default=None, help="bearer key (default: $BATON_API_KEY)")
    p.add_argument("--warmup-requests", type=int, default=1)


def _add_hf_args(p: argparse.ArgumentParser) -> None:
    _add_common(p)
    p.add_argument("--model-path", required=True)
    p.add_argument("--mode", choices=("batched", "sequential"), default="batched")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))


def _add_compare_args(p: argparse.ArgumentParser) -> None:
    _add_common(p)
    p.add_argument("--model-path", required=True)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--engine-args", default="", help="flags added to every engine, e.g. --engine-args='--page-size 16'")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:ENGINE_ARGS",
                   help="repeatable; e.g. radix: and noradix:--disable-radix-cache (default: one variant 'baton')")
    p.add_argument("--hf-modes", default="batched,sequential", help="comma list; empty to skip HF")
    p.add_argument("--device", default="cpu", help="for the engines and HF alike")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for /health")
    p.add_argument("--api-key", default=None, help="bearer key (default: $BATON_API_KEY)")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds interleaving every variant and HF mode on fresh prompts, engines kept up; "
                        "prints medians of the per-round ratios")
    p.add_argument("--warmup-rounds", type=int, default=0,
                   help="rounds run first and left out of the figures (GPU: first full batches pay one-time costs)")


def run_cli(args: argparse.Namespace) -> int:
    if args.bench_command in ("kv-transfer", "pd-ttft", "step"):
        from baton.engine.bench import kv_transfer, pd_ttft, step

        return {"kv-transfer": kv_transfer, "pd-ttft": pd_ttft, "step": step}[args.bench_command].run_cli(args)
    runners = {"serving": _run_serving, "hf": _run_hf, "compare": _run_compare}
    results = runners[args.bench_command](args)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=2)
        print(f"results written to {args.json_out}")
    return 0


def _run_serving(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    from baton.engine.bench.client import resolve_model_name, run_serving_benchmark
    from baton.engine.bench.report import format_serving

    api_key = args.api_key or os.environ.get("BATON_API_KEY")
    config = workload_config_from_args(args)
    prompts = build_workload(AutoTokenizer.from_pretrained(args.tokenizer), config)
    model = args.model or resolve_model_name(args.base_url, api_key)
    summary = run_serving_benchmark(args.base_url, model, prompts, args.concurrency, api_key, args.warmup_requests)
    summary["workload"] = dataclasses.asdict(config)
    print(format_serving(summary))
    return summary


def _run_hf(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    from baton.engine.bench.hf_baseline import run_hf_baseline
    from baton.engine.bench.report import format_hf

    config = workload_config_from_args(args)
    if config.images_per_request:
        raise SystemExit("baton bench hf: the HF baseline runs the text workload only (--images-per-request 0)")
    prompts = build_workload(AutoTokenizer.from_pretrained(args.model_path), config)
    result = run_hf_baseline(args.model_path, prompts, args.mode, args.device, args.dtype)
    print(format_hf(result))
    return result


def _run_compare(args: argparse.Namespace) -> dict:
    from baton.engine.bench.compare import Variant, parse_variant, run_compare

    variants = [parse_variant(v) for v in args.variant] or [Variant("baton", ())]
    common = ["--device", args.device, "--dtype", args.dtype, *shlex.split(args.engine_args)]
    hf_modes = [m.strip() for m in args.hf_modes.split(",") if m.strip()]
    return run_compare(args.model_path, workload_config_from_args(args), args.concurrency, variants,
                       common_args=common, hf_modes=hf_modes, device=args.device, dtype=args.dtype,
                       startup_timeout_s=args.startup_timeout,
                       api_key=args.api_key or os.environ.get("BATON_API_KEY"), repeats=args.repeats,
                       warmup_rounds=args.warmup_rounds)

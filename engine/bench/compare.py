"""`baton bench compare`: engine variants and the HF baseline on the same prompts, in one run.

Each variant starts its own engine (`baton serve --model-path DIR --port FREE <common args> <variant
args>`), runs the serving workload and is stopped before the next starts; the HF baselines run last,
with no engine left competing for the CPU. Ratios are taken between figures of this one run only.

With `--repeats N` (N > 1) every variant's engine is started first and all stay up (idle engines use
no CPU); then each round draws fresh prompts (seed + round, so no round hits another's prefix cache)
and runs every variant and every HF mode on them, back to back. Interleaving rounds this way lets
drift on a shared machine hit all contenders alike; the summary gives each ratio's median over the
rounds and every round's value. `--warmup-rounds K` runs K such rounds first and leaves them out of
the figures: on a GPU the first full-size batch of each contender pays one-time costs (kernel
selection, allocator growth) that one short warm-up request does not reach.

The image workload (`--images-per-request N`) runs on the engines only (the HF baselines are
skipped: they would time `generate` on text alone); its table and summary are requests/s and TTFT,
with each variant's ratios to the first.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import statistics
from typing import Callable, NamedTuple, Optional

import httpx

from baton.engine.bench.client import auth_headers, resolve_model_name, run_serving_benchmark
from baton.engine.bench.hf_baseline import HFMode, load_hf_model, run_hf_baseline
from baton.engine.bench.launcher import EngineProcess, engine_command, free_port
from baton.engine.bench.report import (format_comparison, format_hf, format_image_comparison, format_image_repeats,
                                       format_repeats, format_serving)
from baton.engine.bench.workload import BenchPrompt, WorkloadConfig, build_workload
from baton.engine.utils.logging import format_phases

# (model_path, port, extra args) -> the command that starts a server; tests substitute a fake one.
CommandFactory = Callable[[str, int, list[str]], list[str]]


class Variant(NamedTuple):
    name: str
    engine_args: tuple[str, ...]


def parse_variant(spec: str) -> Variant:
    """`name:engine args` -> Variant; `radix:` (nothing after the colon) means default flags."""
    name, sep, engine_args = spec.partition(":")
    if not sep or not name:
        raise ValueError(f"--variant wants NAME:ENGINE_ARGS, got {spec!r}")
    return Variant(name, tuple(shlex.split(engine_args)))


def _startup_phases(base_url: str, api_key: Optional[str]) -> str:
    """ "; scheduler: load_weights 3.2 s, ..." from a baton engine's /get_server_info; "" from others."""
    try:
        phases = httpx.get(base_url + "/get_server_info", headers=auth_headers(api_key), timeout=10).json()["startup_s"]
    except Exception:  # any OpenAI server may be benchmarked; the breakdown is a baton extra
        return ""
    return f"; scheduler: {format_phases(phases)}"


def _start(variant: Variant, model_path: str, common_args: list[str], startup_timeout_s: float,
           api_key: Optional[str], command_factory: CommandFactory, stack: contextlib.ExitStack) -> tuple[EngineProcess, str, float]:
    port = free_port()
    command = command_factory(model_path, port, [*common_args, *variant.engine_args])
    print(f"[{variant.name}] starting: {shlex.join(command)}", flush=True)
    engine = stack.enter_context(EngineProcess(command, port, api_key=api_key))
    started_in = engine.wait_healthy(startup_timeout_s, desc=f"[{variant.name}] engine starting")
    print(f"[{variant.name}] healthy after {started_in:.1f} s{_startup_phases(engine.base_url, api_key)}", flush=True)
    try:
        model = resolve_model_name(engine.base_url, api_key)
    except Exception:  # an engine without /v1/models still serves its directory's name
        model = os.path.basename(os.path.normpath(model_path))
    return engine, model, started_in


def _serve(variant: Variant, engine: EngineProcess, model: str, started_in: float, prompts: list[BenchPrompt],
           concurrency: int, api_key: Optional[str]) -> dict:
    print(f"[{variant.name}] running {len(prompts)} requests", flush=True)
    summary = run_serving_benchmark(engine.base_url, model, prompts, concurrency, api_key)
    summary.update(variant=variant.name, engine_args=list(variant.engine_args), startup_s=started_in)
    print(format_serving(summary, title=f"baton [{variant.name}]"), flush=True)
    return summary


def run_variant(variant: Variant, model_path: str, prompts: list[BenchPrompt], concurrency: int,
                common_args: list[str], startup_timeout_s: float, api_key: Optional[str],
                command_factory: CommandFactory = engine_command) -> dict:
    with contextlib.ExitStack() as stack:
        engine, model, started_in = _start(variant, model_path, common_args, startup_timeout_s, api_key,
                                           command_factory, stack)
        return _serve(variant, engine, model, started_in, prompts, concurrency, api_key)


def _run_hf_modes(model_path: str, prompts: list[BenchPrompt], hf_modes, device: str, dtype: str,
                  model_and_tokenizer) -> dict:
    out = {}
    for mode in hf_modes:
        print(f"[HF-{HFMode(mode).value}] generating {len(prompts)} requests, "
              f"{sum(p.output_len for p in prompts)} output tokens", flush=True)
        result = run_hf_baseline(model_path, prompts, mode, device, dtype, model_and_tokenizer)
        out[result["mode"]] = result
        print(format_hf(result), flush=True)
    return out


def run_compare(model_path: str, workload: WorkloadConfig, concurrency: int, variants: list[Variant],
                common_args: list[str] = (), hf_modes: list[HFMode] = (HFMode.BATCHED, HFMode.SEQUENTIAL),
                device: str = "cpu", dtype: str = "float32", startup_timeout_s: float = 600.0,
                api_key: Optional[str] = None, command_factory: CommandFactory = engine_command,
                repeats: int = 1, warmup_rounds: int = 0) -> dict:
    """Run every variant, then each HF mode; print the side-by-side table and return all figures.
    repeats > 1 (or warm-up rounds): interleaved rounds (see the module docstring); results["rounds"]
    holds each counted one."""
    assert variants, "at least one variant"
    assert len({v.name for v in variants}) == len(variants), "variant names must differ"
    assert repeats >= 1, "repeats must be >= 1"
    assert warmup_rounds >= 0, "warmup_rounds must be >= 0"
    from transformers import AutoTokenizer

    if workload.images_per_request and hf_modes:
        print("HF baselines skipped: the image workload runs on the engines only", flush=True)
        hf_modes = ()

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if repeats == 1 and not warmup_rounds:
        prompts = build_workload(tokenizer, workload)
        results = {"workload": dataclasses.asdict(workload), "concurrency": concurrency, "variants": {}, "hf": {}}
        for variant in variants:
            results["variants"][variant.name] = run_variant(variant, model_path, prompts, concurrency,
                                                            list(common_args), startup_timeout_s, api_key,
                                                            command_factory)
        if hf_modes:
            results["hf"] = _run_hf_modes(model_path, prompts, hf_modes, device, dtype,
                                          load_hf_model(model_path, device, dtype))
        print(_comparison(workload, results["variants"], results["hf"]), flush=True)
        return results

    results = {"workload": dataclasses.asdict(workload), "concurrency": concurrency, "repeats": repeats, "rounds": []}
    model_and_tokenizer = load_hf_model(model_path, device, dtype) if hf_modes else None
    with contextlib.ExitStack() as stack:
        engines = {v.name: _start(v, model_path, list(common_args), startup_timeout_s, api_key, command_factory, stack)
                   for v in variants}
        for round_ in range(-warmup_rounds, repeats):
            # warm-up rounds draw seeds past the counted ones: no counted round meets their prefixes
            seed = workload.seed + (round_ if round_ >= 0 else repeats - round_ - 1)
            prompts = build_workload(tokenizer, dataclasses.replace(workload, seed=seed))
            print(f"== warm-up round {round_ + warmup_rounds + 1}/{warmup_rounds} (not counted) ==" if round_ < 0
                  else f"== round {round_ + 1}/{repeats} ==", flush=True)
            served = {v.name: _serve(v, *engines[v.name], prompts, concurrency, api_key) for v in variants}
            hf = _run_hf_modes(model_path, prompts, hf_modes, device, dtype, model_and_tokenizer) if hf_modes else {}
            print(_comparison(workload, served, hf), flush=True)
            if round_ >= 0:
                results["rounds"].append({"variants": served, "hf": hf})
    if workload.images_per_request:
        results["summary"] = summarize_image_rounds(results["rounds"])
        print(format_image_repeats(results["summary"]), flush=True)
    else:
        results["summary"] = summarize_rounds(results["rounds"])
        print(format_repeats(results["summary"]), flush=True)
    return results


def _comparison(workload: WorkloadConfig, variants: dict[str, dict], hf: dict[str, dict]) -> str:
    return format_image_comparison(variants) if workload.images_per_request else format_comparison(variants, hf)


def summarize_rounds(rounds: list[dict]) -> dict:
    """For each variant: output tok/s per round and its ratio to the first variant and to each HF
    mode per round, with medians. A ratio is always between figures of the same round."""
    names = list(rounds[0]["variants"])
    first = names[0]
    summary = {}
    for name in names:
        tps = [r["variants"][name]["output_throughput"] for r in rounds]
        ratios = {"vs " + first: [t / r["variants"][first]["output_throughput"] for t, r in zip(tps, rounds)]}
        for mode in rounds[0]["hf"]:
            ratios["vs HF-" + mode] = [t / r["hf"][mode]["output_throughput"] for t, r in zip(tps, rounds)]
        summary[name] = {"output_throughput": tps, "median_output_throughput": statistics.median(tps),
                         "ratios": {k: {"rounds": v, "median": statistics.median(v)} for k, v in ratios.items()}}
    return summary


# The image workload's figures per variant and round, and those taken as ratios to the first variant.
_IMAGE_FIGURES: dict[str, Callable[[dict], float]] = {
    "request_throughput": lambda s: s["request_throughput"], "ttft_mean_ms": lambda s: s["ttft"]["mean_ms"],
    "ttft_p50_ms": lambda s: s["ttft"]["p50_ms"], "ttft_p99_ms": lambda s: s["ttft"]["p99_ms"]}
_IMAGE_RATIOS = {"request_throughput": "req/s", "ttft_mean_ms": "TTFT mean", "ttft_p50_ms": "TTFT p50"}


def summarize_image_rounds(rounds: list[dict]) -> dict:
    """For each variant: requests/s and TTFT per round with medians, and the requests/s and TTFT
    ratios to the first variant per round (this / first), with medians."""
    names = list(rounds[0]["variants"])
    first = names[0]
    summary = {}
    for name in names:
        figures = {f: [get(r["variants"][name]) for r in rounds] for f, get in _IMAGE_FIGURES.items()}
        ratios = {}
        for f, label in _IMAGE_RATIOS.items():
            firsts = [_IMAGE_FIGURES[f](r["variants"][first]) for r in rounds]
            ratios[f"{label} vs {first}"] = [v / b if b else 0.0 for v, b in zip(figures[f], firsts)]
        summary[name] = {**figures, **{"median_" + f: statistics.median(v) for f, v in figures.items()},
                         "ratios": {k: {"rounds": v, "median": statistics.median(v)} for k, v in ratios.items()}}
    return summary

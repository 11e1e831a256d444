"""`baton bench compare`: engine variants and the HF baseline on the same prompts, in one run.

Each variant starts its own engine (`baton serve --model-path DIR --port FREE <common args> <variant
args>`), runs the serving workload and is stopped before the next starts; the HF baselines run last,
with no engine left competing for the CPU. Ratios are taken between figures of this one run only.
"""
from __future__ import annotations

import dataclasses
import os
import shlex
from typing import Callable, NamedTuple, Optional

from baton.engine.bench.client import resolve_model_name, run_serving_benchmark
from baton.engine.bench.hf_baseline import HFMode, load_hf_model, run_hf_baseline
from baton.engine.bench.launcher import EngineProcess, engine_command, free_port
from baton.engine.bench.report import format_comparison, format_hf, format_serving
from baton.engine.bench.workload import BenchPrompt, WorkloadConfig, build_workload

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


def run_variant(variant: Variant, model_path: str, prompts: list[BenchPrompt], concurrency: int,
                common_args: list[str], startup_timeout_s: float, api_key: Optional[str],
                command_factory: CommandFactory = engine_command) -> dict:
    port = free_port()
    command = command_factory(model_path, port, [*common_args, *variant.engine_args])
    print(f"[{variant.name}] starting: {shlex.join(command)}", flush=True)
    with EngineProcess(command, port, api_key=api_key) as engine:
        started_in = engine.wait_healthy(startup_timeout_s, desc=f"[{variant.name}] engine starting")
        print(f"[{variant.name}] healthy after {started_in:.1f} s; running {len(prompts)} requests", flush=True)
        try:
            model = resolve_model_name(engine.base_url, api_key)
        except Exception:  # an engine without /v1/models still serves its directory's name
            model = os.path.basename(os.path.normpath(model_path))
        summary = run_serving_benchmark(engine.base_url, model, prompts, concurrency, api_key)
    summary.update(variant=variant.name, engine_args=list(variant.engine_args), startup_s=started_in)
    print(format_serving(summary, title=f"baton [{variant.name}]"), flush=True)
    return summary


def run_compare(model_path: str, workload: WorkloadConfig, concurrency: int, variants: list[Variant],
                common_args: list[str] = (), hf_modes: list[HFMode] = (HFMode.BATCHED, HFMode.SEQUENTIAL),
                device: str = "cpu", dtype: str = "float32", startup_timeout_s: float = 600.0,
                api_key: Optional[str] = None, command_factory: CommandFactory = engine_command) -> dict:
    """Run every variant, then each HF mode; print the side-by-side table and return all figures."""
    assert variants, "at least one variant"
    assert len({v.name for v in variants}) == len(variants), "variant names must differ"
    from transformers import AutoTokenizer

    prompts = build_workload(AutoTokenizer.from_pretrained(model_path), workload)
    results = {"workload": dataclasses.asdict(workload), "concurrency": concurrency, "variants": {}, "hf": {}}
    for variant in variants:
        results["variants"][variant.name] = run_variant(variant, model_path, prompts, concurrency,
                                                        list(common_args), startup_timeout_s, api_key,
                                                        command_factory)
    if hf_modes:
        model_and_tokenizer = load_hf_model(model_path, device, dtype)
        for mode in hf_modes:
            print(f"[HF-{HFMode(mode).value}] generating {len(prompts)} requests, {sum(p.output_len for p in prompts)} output tokens", flush=True)
            result = run_hf_baseline(model_path, prompts, mode, device, dtype, model_and_tokenizer)
            results["hf"][result["mode"]] = result
            print(format_hf(result), flush=True)
    print(format_comparison(results["variants"], results["hf"]), flush=True)
    return results

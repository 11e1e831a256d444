"""Human-readable text for benchmark results (the dicts of `metrics.summarize` and `hf_baseline`)."""
from __future__ import annotations

from typing import Optional


def format_serving(summary: dict, title: str = "serving benchmark") -> str:
    lines = [
        f"== {title} ==",
        f"requests: {summary['completed']}/{summary['requests']} completed"
        + (f", {summary['failed']} failed: {summary['errors']}" if summary["failed"] else ""),
        f"duration: {summary['duration_s']:.2f} s   input tokens: {summary['input_tokens']}   "
        f"output tokens: {summary['output_tokens']}"
        + ("" if summary["usage_reported"] else "  (no usage chunk: counted text chunks)"),
        f"output tok/s: {summary['output_throughput']:.1f}   request/s: {summary['request_throughput']:.2f}",
        f"{'':6}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}   (ms)",
    ]
    for name in ("ttft", "itl", "e2e"):
        s = summary[name]
        lines.append(f"{name:6}{s['mean_ms']:10.1f}{s['p50_ms']:10.1f}{s['p90_ms']:10.1f}{s['p99_ms']:10.1f}")
    if summary.get("images_per_request"):
        lines.insert(2, f"images: {summary['images_per_request']} per request" + _mm_text(summary.get("mm")))
    return "\n".join(lines)


def _mm_text(mm: Optional[dict]) -> str:
    """The server's vision counters over the run, where it reports them."""
    if not mm:
        return ""
    return (f"   encoded: {mm['mm_images_encoded']}   embedding cache hits: {mm['mm_cache_hits']}, "
            f"misses: {mm['mm_cache_misses']}")


def format_hf(result: dict) -> str:
    return (f"== HF transformers, {result['mode']} (batch {result['batch_size']}) ==\n"
            f"requests: {result['requests']}   output tokens: {result['output_tokens']}   "
            f"duration: {result['duration_s']:.2f} s\n"
            f"output tok/s: {result['output_throughput']:.1f}   request/s: {result['request_throughput']:.2f}")


def _ratio(a: float, b: Optional[float]) -> str:
    return f"{a / b:.2f}x" if b else "-"


def format_comparison(variants: dict[str, dict], hf: dict[str, dict]) -> str:
    """One row per engine variant, then one per HF mode. Ratios are output tok/s over the first
    variant's and over each HF mode's, all measured in this run."""
    first = next(iter(variants.values()))["output_throughput"] if variants else None
    hf_cols = [m for m in ("batched", "sequential") if m in hf]
    header = (f"{'':16}{'out tok/s':>11}{'req/s':>8}{'TTFT p50':>10}{'ITL p50':>9}{'e2e p50':>9}"
              f"{'vs first':>10}" + "".join(f"{'vs HF-' + m[:3]:>10}" for m in hf_cols))
    rows = [header, "-" * len(header)]
    for name, s in variants.items():
        tps = s["output_throughput"]
        rows.append(f"{name[:16]:16}{tps:11.1f}{s['request_throughput']:8.2f}{s['ttft']['p50_ms']:10.1f}"
                    f"{s['itl']['p50_ms']:9.1f}{s['e2e']['p50_ms']:9.1f}{_ratio(tps, first):>10}"
                    + "".join(f"{_ratio(tps, hf[m]['output_throughput']):>10}" for m in hf_cols))
    for m in hf_cols:
        r = hf[m]
        rows.append(f"{('HF-' + m)[:16]:16}{r['output_throughput']:11.1f}{r['request_throughput']:8.2f}"
                    f"{'-':>10}{'-':>9}{'-':>9}{_ratio(r['output_throughput'], first):>10}")
    return "\n".join(["== comparison (same prompts, same run; ms latencies) =="] + rows)


def format_repeats(summary: dict) -> str:
    """The medians over interleaved rounds (compare --repeats), each with every round's value."""
    rows = ["== summary over rounds (median; each round's value in brackets) =="]
    for name, s in summary.items():
        per_round = " ".join(f"{t:.0f}" for t in s["output_throughput"])
        rows.append(f"{name}: out tok/s {s['median_output_throughput']:.1f} [{per_round}]")
        for label, r in s["ratios"].items():
            rows.append(f"    {label:14} {r['median']:.2f}x  [{' '.join(f'{x:.2f}' for x in r['rounds'])}]")
    return "\n".join(rows)


def format_image_comparison(variants: dict[str, dict]) -> str:
    """The image workload side by side: requests/s and TTFT per variant, the ratios to the first
    variant (req/s: this / first, above 1 is faster; TTFT: this / first, below 1 is faster), and how
    many pictures each engine encoded and found in its embeddings' cache."""
    first = next(iter(variants.values()))
    header = (f"{'':16}{'req/s':>8}{'TTFT mean':>11}{'TTFT p50':>10}{'TTFT p99':>10}{'req/s/first':>13}"
              f"{'TTFT p50/first':>16}{'encoded':>9}{'hits':>6}")
    rows = [header, "-" * len(header)]
    for name, s in variants.items():
        t, mm = s["ttft"], s.get("mm") or {}
        rows.append(f"{name[:16]:16}{s['request_throughput']:8.2f}{t['mean_ms']:11.1f}{t['p50_ms']:10.1f}"
                    f"{t['p99_ms']:10.1f}{_ratio(s['request_throughput'], first['request_throughput']):>13}"
                    f"{_ratio(t['p50_ms'], first['ttft']['p50_ms']):>16}"
                    f"{mm.get('mm_images_encoded', '-'):>9}{mm.get('mm_cache_hits', '-'):>6}")
    return "\n".join(["== comparison, image workload (same prompts and pictures, same run; ms latencies) =="] + rows)


def format_image_repeats(summary: dict) -> str:
    """The image workload's medians over interleaved rounds, each with every round's value."""
    rows = ["== summary over rounds (median; each round's value in brackets) =="]
    for name, s in summary.items():
        for figure, fmt in (("request_throughput", "{:.2f}"), ("ttft_mean_ms", "{:.0f}"), ("ttft_p50_ms", "{:.0f}"),
                            ("ttft_p99_ms", "{:.0f}")):
            values = " ".join(fmt.format(v) for v in s[figure])
            rows.append(f"{name}: {figure} {fmt.format(s['median_' + figure])} [{values}]")
        for label, r in s["ratios"].items():
            rows.append(f"    {label:24} {r['median']:.2f}x  [{' '.join(f'{x:.2f}' for x in r['rounds'])}]")
    return "\n".join(rows)

"""Per-request measurements of a serving run and their summary (throughputs, latency percentiles)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    """One streamed request, as the client saw it. Times are seconds from `time.perf_counter`."""

    prompt_len: int
    success: bool = False
    ttft: float = 0.0  # request sent -> first chunk carrying text
    e2e: float = 0.0  # request sent -> stream closed
    itl: list[float] = field(default_factory=list)  # gaps between consecutive text chunks
    output_tokens: int = 0  # from the final `usage` chunk, else the number of text chunks
    usage_reported: bool = False
    error: str = ""


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default); 0.0 for no values."""
    return float(np.percentile(values, q)) if values else 0.0


def latency_stats(values_s: list[float]) -> dict[str, float]:
    """Mean and percentiles of latencies given in seconds, reported in milliseconds."""
    ms = [v * 1000.0 for v in values_s]
    stats = {"mean_ms": float(np.mean(ms)) if ms else 0.0}
    for q in PERCENTILES:
        stats[f"p{q}_ms"] = percentile(ms, q)
    return stats


def summarize(results: list[RequestResult], duration_s: float) -> dict:
    """The figures a serving benchmark prints: counts, throughputs, TTFT/ITL/e2e statistics."""
    ok = [r for r in results if r.success]
    output_tokens = sum(r.output_tokens for r in ok)
    input_tokens = sum(r.prompt_len for r in ok)
    return {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.success})[:5],
        "duration_s": duration_s,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "usage_reported": all(r.usage_reported for r in ok) if ok else False,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else 0.0,
        "input_throughput": input_tokens / duration_s if duration_s > 0 else 0.0,
        "output_throughput": output_tokens / duration_s if duration_s > 0 else 0.0,
        "ttft": latency_stats([r.ttft for r in ok]),
        "itl": latency_stats([gap for r in ok for gap in r.itl]),
        "e2e": latency_stats([r.e2e for r in ok]),
    }

"""Logging setup shared by the engine's processes."""
from __future__ import annotations

import logging


def configure_logging(level: str, prefix: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format=f"%(asctime)s [{prefix}] %(levelname)s %(name)s: %(message)s", force=True)


def format_phases(seconds: dict[str, float]) -> str:
    """{"load_weights": 3.2, "total": 9.1} -> "load_weights 3.2 s, total 9.1 s" (start-up lines)."""
    return ", ".join(f"{name} {s:.1f} s" for name, s in seconds.items())

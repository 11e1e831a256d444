"""Logging setup shared by the engine's processes."""
from __future__ import annotations

import logging


def configure_logging(level: str, prefix: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format=f"%(asctime)s [{prefix}] %(levelname)s %(name)s: %(message)s", force=True)

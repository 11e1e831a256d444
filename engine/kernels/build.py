"""Compile a native kernel's C source once per machine and cache the shared library.

`$CC` (default `cc`) builds into `$BATON_KERNEL_CACHE` (default `~/.cache/baton/kernels`, or the
temp dir when that is not writable). The file name carries a hash of the source, the compiler, its
flags and the CPU's feature flags, so a cache shared between different machines never loads code
built for another CPU. The build writes to a temporary name and renames, so concurrent engines
starting on one machine cannot load a half-written library.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)

# gnu11, not c11: strict ISO mode turns off FMA contraction (-ffp-contract=off) in the portable loops.
DEFAULT_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11"]


class KernelUnavailable(RuntimeError):
    pass


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    configured = os.environ.get("BATON_KERNEL_CACHE")
    candidates = [Path(configured)] if configured else [Path.home() / ".cache" / "baton" / "kernels",
                                                        Path(tempfile.gettempdir()) / f"baton-kernels-{os.getuid()}"]
    for path in candidates:
        try:
            path.mkdir(parents=True, exist_ok=True)
            if os.access(path, os.W_OK):
                return path
        except OSError:
            continue
    raise KernelUnavailable(f"no writable kernel cache directory (tried {', '.join(map(str, candidates))})")


def _compiler() -> str:
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        raise KernelUnavailable(f"no C compiler: {cc!r} is not on PATH (set CC, or install gcc)")
    return cc


_INCLUDED_SOURCE = re.compile(r'^\s*#include\s+"([^"]+\.c)"', re.MULTILINE)


def _included_sources(source: Path, seen: Optional[set] = None) -> list[str]:
    """The text of every `.c` file `source` includes with `#include "name.c"`, recursively."""
    seen = set() if seen is None else seen
    texts = []
    for name in _INCLUDED_SOURCE.findall(source.read_text()):
        path = source.parent / name
        if path not in seen:
            seen.add(path)
            texts += [path.read_text(), *_included_sources(path, seen)]
    return texts


def build_library(source: Path, cflags: list[str] = DEFAULT_CFLAGS) -> Path:
    """Compile `source` unless a library for this source, compiler, flags and CPU is already cached."""
    cc = _compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    # what `#include "x.h"` may pull in, and the sources a source includes whole (cpu_forward.c)
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))] + _included_sources(source)
    key = hashlib.sha256("\0".join([source.read_text(), *headers, cc, version, " ".join(cflags), platform.machine(),
                                    _cpu_flags()]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run([cc, *cflags, str(source), "-o", tmp, "-lm"], capture_output=True, text=True)
        if result.returncode != 0:
            raise KernelUnavailable(f"{cc} failed to build {source.name}: {result.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("built %s", target)
    return target


def load_failure(load: Callable[[], Any]) -> Optional[str]:
    """None when `load()` (a kernel module's library loader) builds and loads; otherwise why not."""
    try:
        load()
    except (KernelUnavailable, OSError) as e:
        return str(e)
    return None

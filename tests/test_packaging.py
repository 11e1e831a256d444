"""A built wheel is enough to run Baton: installed (not editable) into a fresh venv, it compiles every
native CPU kernel from the files it ships, so no source the kernels need is left out of the package data."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT = ["setup.py", "pyproject.toml", "README.md", "baton", "engine", "router", "operator"]

# In the fresh venv: every kernel library (each .c in the installed kernels folder is one, the way
# engine/kernels/*.py and engine/distributed/shm_group.py build them), built into an empty cache.
BUILD_EVERY_KERNEL = textwrap.dedent("""
    import sys
    from pathlib import Path

    from baton.engine.kernels import build

    kernels = Path(build.__file__).parent
    assert Path(sys.prefix) in kernels.parents, f"not the installed package: {kernels}"
    sources = sorted(kernels.glob("*.c"))
    assert sources, f"no kernel sources in {kernels}"
    for source in sources:
        print(build.build_library(source).name, flush=True)
""")


def _run(*args: str, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(args, capture_output=True, text=True, **kw)
    assert r.returncode == 0, f"{' '.join(args)}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.mark.slow
def test_an_installed_wheel_builds_every_cpu_kernel(tmp_path):
    if shutil.which("cc") is None:
        pytest.skip("no C compiler (cc) to build the kernels with")
    src = tmp_path / "src"  # a copy, so the build leaves nothing behind in the checkout
    src.mkdir()
    for name in PROJECT:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        else:
            shutil.copy2(ROOT / name, src / name)
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"),
         str(src))
    wheel, = (tmp_path / "dist").glob("baton-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    kernels = {f"baton/engine/kernels/{p.name}" for p in (ROOT / "engine" / "kernels").iterdir()
               if p.suffix in (".py", ".c", ".h")}
    assert kernels <= shipped, f"missing from the wheel: {sorted(kernels - shipped)}"
    assert not [n for n in shipped if n.startswith(("baton_testing/", "tests/"))], "test support in the wheel"

    # the kernels' build needs only the standard library, so the venv needs nothing but the wheel
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", str(venv))
    python = venv / "bin" / "python"
    _run(sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel))

    env = {**os.environ, "BATON_KERNEL_CACHE": str(tmp_path / "cache")}  # -I: no PYTHONPATH, no checkout
    built = _run(str(python), "-I", "-c", BUILD_EVERY_KERNEL, cwd=tmp_path, env=env).stdout.split()
    assert len(built) == len(list((ROOT / "engine" / "kernels").glob("*.c"))), built

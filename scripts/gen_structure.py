#!/usr/bin/env python3
"""Regenerates docs/structure.md: one line per module, from each module's docstring (and per C source of the
CPU kernels, from its opening comment), under the import rules tests/test_imports.py checks.

    python scripts/gen_structure.py          # rewrite docs/structure.md
    python scripts/gen_structure.py --check  # exit 1 if it is out of date
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMPONENTS = [("baton", "baton"), ("engine", "baton.engine"), ("router", "baton.router"), ("operator", "baton.operator")]
HEADER = """# Structure

One line per module, generated from the module docstrings (and the C sources' opening comments) by
`python scripts/gen_structure.py` (a test fails when this file is out of date). Tests live in
`tests/<component>/`; test doubles and harnesses in `tests/support/`, which the package does not ship.

## Import rules

`tests/test_imports.py` checks them on the source (imports under `if TYPE_CHECKING:` name types and are
exempt; an import inside a function is a dependency like any other):

- **No import cycles** among the engine's modules: none at module level, and none closed by an import
  deferred into a function, except the few the test lists, each with the change that ends it.
- **The engine's layers import downward only.** A module imports from its own layer and the layers
  below it; bottom to top:
  1. `kernels/`, `triton_ops/`, `utils/`
  2. `distributed/`, `mem_cache/`, `sampling/`, `constrained/`, `parsers/`, `io_struct.py`,
     `server_args.py`, `metrics.py`, `model_structure.py`, `model_config.py`
  3. `layers/`
  4. `models/`
  5. `model_executor/`
  6. `disaggregation/`, `speculative/`
  7. `scheduler/`
  8. `tokenizer_manager.py`, `detokenizer.py`
  9. `entrypoints/`, `bench/`

  So models never import the model runner or the scheduler, the kernels import nothing above them
  (one known exception, listed in the test), and PD and speculation reach the scheduler through type
  hints only.
- **The router and the operator never import the engine**, not even inside a function: they run
  where the engine is not installed.
- **No import cycles in the router** either, deferred imports included, and no exceptions: the flows
  (`regular.py`, `pd.py`) import `dispatch.py`, and the `Router` hands the `Dispatcher` its flow.
"""


def first_line(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text()))
    return (doc or "").strip().split("\n")[0].strip() or "(no docstring)"


def c_summary(path: Path) -> str:
    """The first sentence of a C source's opening comment (`/* ... */` or `//` lines)."""
    lines = []
    for line in path.read_text().splitlines():
        text = line.strip().removeprefix("/*").removeprefix("//").removeprefix("*").strip()
        if not text or text.startswith("#"):
            break
        lines.append(text.removesuffix("*/").strip())
    first = " ".join(lines)
    return (first.split(". ")[0].rstrip(".") + ".") if first else "(no opening comment)"


def c_sources() -> list[str]:
    """Each C source of the CPU kernels with its summary and what builds it (a Python module naming
    it, or the C sources that include it)."""
    kernels = ROOT / "engine" / "kernels"
    python = [p for p in sorted((ROOT / "engine").rglob("*.py")) if "__pycache__" not in p.parts]
    sources = sorted(kernels.glob("*.c")) + sorted(kernels.glob("*.h"))
    out = []
    for path in sources:
        built = [p.relative_to(ROOT).as_posix() for p in python if f'"{path.name}"' in p.read_text()]
        included = [s.name for s in sources if f'#include "{path.name}"' in s.read_text()]
        uses = [f"built by `{b}`" for b in built] + ([f"included by {', '.join(included)}"] if included else [])
        said = "; ".join(uses)
        out.append(f"- `{path.relative_to(ROOT).as_posix()}` — {c_summary(path)}"
                   + (f" {said[0].upper()}{said[1:]}." if said else ""))
    return out


def render() -> str:
    out = [HEADER]
    for folder, package in COMPONENTS:
        out.append(f"\n## `{folder}/` — `{package}`\n")
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            rel = path.relative_to(ROOT).as_posix()
            out.append(f"- `{rel}` — {first_line(path)}")
        if folder == "engine":
            out.append("\nThe CPU kernels' C sources, compiled on first use (`engine/kernels/build.py`):\n")
            out.extend(c_sources())
    return "\n".join(out) + "\n"


def main() -> int:
    target = ROOT / "docs" / "structure.md"
    text = render()
    if "--check" in sys.argv:
        if target.read_text() != text:
            print("docs/structure.md is out of date: run python scripts/gen_structure.py")
            return 1
        return 0
    target.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

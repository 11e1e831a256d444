#!/usr/bin/env python3
"""Regenerates docs/structure.md: one line per module, from each module's docstring.

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

One line per module, generated from the module docstrings by `python scripts/gen_structure.py`
(a test fails when this file is out of date). Layers import downward only: models never import the
scheduler; router and operator never import the engine. Tests live in `tests/<component>/`.
"""


def first_line(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text()))
    return (doc or "").strip().split("\n")[0].strip() or "(no docstring)"


def render() -> str:
    out = [HEADER]
    for folder, package in COMPONENTS:
        out.append(f"\n## `{folder}/` — `{package}`\n")
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            rel = path.relative_to(ROOT).as_posix()
            out.append(f"- `{rel}` — {first_line(path)}")
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

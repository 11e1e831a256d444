"""The import rules of docs/structure.md (scripts/gen_structure.py's HEADER), read from the source with
`ast`: no import cycles among the engine's modules, no import from a lower layer of the engine into a
higher one, no import cycles among the router's modules, and the router and the operator never import
the engine.

An import under `if TYPE_CHECKING:` runs nothing, but it ties the two modules together all the same
(a reader of one must know the other; the shared types belong below both, in engine/core/): it counts.
An import inside a function runs when the function does: it is a dependency too (a cycle that only
works because one side imports late is still a cycle), checked separately from the module-level ones,
where Python itself would fail."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"engine": "baton.engine", "router": "baton.router", "operator": "baton.operator"}

# The engine's layers, bottom to top: a module imports from its own layer and the layers below it.
# A name is a subpackage or a module directly under engine/.
LAYERS = [
    ("kernels", "triton_ops", "utils"),
    ("distributed", "mem_cache", "sampling", "constrained", "parsers", "io_struct", "server_args", "metrics",
     "model_structure", "model_config", "multimodal"),
    ("core",),
    ("layers",),
    ("models",),
    ("model_executor",),
    ("disaggregation", "speculative"),
    ("worker",),
    ("scheduler",),
    ("tokenizer_manager", "detokenizer"),
    ("entrypoints", "bench"),
]

# Known violations, each with the change that ends it. These tests fail on any other violation, and on
# an entry here that no longer is one: delete it then.
KNOWN_CYCLES: set[tuple[str, str]] = set()
KNOWN_UPWARD: set[tuple[str, str]] = set()


class Import(NamedTuple):
    target: str  # the module imported (the closest module that exists, for `from package import name`)
    line: int
    deferred: bool  # inside a function


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [PACKAGES[rel.parts[0]], *rel.parts[1:]]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for folder in PACKAGES for p in sorted((ROOT / folder).rglob("*.py"))
           if "__pycache__" not in p.parts}


def _resolve(name: str) -> str:
    """The module `name` runs: itself, or for `from package import function` the package."""
    while name and name not in MODULES and name.startswith("baton."):
        name = name.rpartition(".")[0]
    return name


def imports_of(module: str) -> Iterator[Import]:
    """Every import in the module, with its line (those under `if TYPE_CHECKING:` too)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    yield from imports_in(path.read_text(), package)


def imports_in(source: str, package: str) -> Iterator[Import]:
    """The imports of a module's source whose package is `package`."""

    def walk(nodes: list[ast.AST], deferred: bool) -> Iterator[Import]:
        for node in nodes:
            if isinstance(node, ast.Import):
                yield from (Import(alias.name, node.lineno, deferred) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    yield Import(sub if sub in MODULES else base, node.lineno, deferred)
            inner = deferred or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield from walk(list(ast.iter_child_nodes(node)), inner)

    yield from walk(ast.parse(source).body, False)


def graph(prefix: str, deferred: bool, parents: bool = True) -> dict[str, dict[str, int]]:
    """module -> {module it imports: line} among modules under `prefix`; with `deferred`, the imports
    inside functions too. Importing a.b.c also runs a.b's __init__ (unless the importer is inside a.b):
    with `parents`, an edge to it too."""
    edges: dict[str, dict[str, int]] = {}
    for module in MODULES:
        if not module.startswith(prefix):
            continue
        out = edges.setdefault(module, {})
        for imp in imports_of(module):
            if imp.deferred and not deferred:
                continue
            target = _resolve(imp.target)
            while target.startswith(prefix) and target != module and not module.startswith(target + "."):
                out.setdefault(target, imp.line)
                target = target.rpartition(".")[0] if parents else ""
    return edges


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def describe(component: list[str], edges: dict[str, dict[str, int]]) -> str:
    return "\n".join(f"  {a} -> {b} ({MODULES[a].relative_to(ROOT)}:{line})"
                     for a in component for b, line in sorted(edges[a].items()) if b in component)


def without(edges: dict[str, dict[str, int]], known: set[tuple[str, str]]) -> dict[str, dict[str, int]]:
    return {a: {b: line for b, line in out.items() if (a, b) not in known} for a, out in edges.items()}


def layer_of(module: str) -> int:
    if module == "baton.engine":
        return len(LAYERS)  # the package's __init__, above everything
    name = module.split(".")[2]
    for i, names in enumerate(LAYERS):
        if name in names:
            return i
    raise AssertionError(f"{module}: engine/{name} is in no layer of LAYERS (tests/test_imports.py); add it")


def upward_imports() -> dict[tuple[str, str], int]:
    found = {}
    for a, out in graph("baton.engine.", deferred=True, parents=False).items():
        for b, line in out.items():
            if layer_of(b) > layer_of(a):
                found[(a, b)] = line
    return found


def test_no_import_cycles_at_module_level():
    edges = graph("baton.engine.", deferred=False)
    found = cycles(edges)
    assert not found, "import cycles among the engine's modules:\n" + "\n".join(describe(c, edges) for c in found)


def test_no_new_import_cycles_through_deferred_imports():
    edges = graph("baton.engine.", deferred=True)
    found = cycles(without(edges, KNOWN_CYCLES))
    assert not found, ("import cycles among the engine's modules (counting imports inside functions):\n"
                       + "\n".join(describe(c, edges) for c in found))
    still = {(a, b) for a, b in KNOWN_CYCLES if b in edges.get(a, {})
             and any(a in c and b in c for c in cycles(edges))}
    assert still == KNOWN_CYCLES, f"no longer a cycle, delete from KNOWN_CYCLES: {sorted(KNOWN_CYCLES - still)}"


def test_engine_layers_import_downward_only():
    found = upward_imports()
    new = {edge: line for edge, line in found.items() if edge not in KNOWN_UPWARD}
    assert not new, "imports into a higher layer of the engine:\n" + "\n".join(
        f"  {a} -> {b} ({MODULES[a].relative_to(ROOT)}:{line})" for (a, b), line in sorted(new.items()))
    assert KNOWN_UPWARD <= set(found), f"fixed, delete from KNOWN_UPWARD: {sorted(KNOWN_UPWARD - set(found))}"


def test_no_import_cycles_in_the_router():
    edges = graph("baton.router.", deferred=True)  # the module-level imports and the deferred ones
    found = cycles(edges)
    assert not found, ("import cycles among the router's modules (counting imports inside functions):\n"
                       + "\n".join(describe(c, edges) for c in found))


def test_router_and_operator_never_import_the_engine():
    found = [f"  {m} -> {imp.target} ({MODULES[m].relative_to(ROOT)}:{imp.line})"
             for m in MODULES if m.startswith(("baton.router", "baton.operator"))
             for imp in imports_of(m) if imp.target == "baton.engine" or imp.target.startswith("baton.engine.")]
    assert not found, "the router and the operator run without the engine installed:\n" + "\n".join(found)


def test_the_checks_see_a_cycle_and_an_upward_import():
    edges = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    assert cycles(edges) == [["a", "b", "c"]]
    assert cycles(without(edges, {("c", "a")})) == []
    assert layer_of("baton.engine.kernels.cpu_forward") < layer_of("baton.engine.models.llama")


def test_a_type_only_import_counts():
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from baton.engine.core.req import Req\n"
              "def f():\n    from baton.engine.scheduler import scheduler\n")
    found = {(imp.target, imp.deferred) for imp in imports_in(source, "baton.engine.layers")}
    assert ("baton.engine.core.req", False) in found
    assert ("baton.engine.scheduler.scheduler", True) in found


MAX_FUNCTION_LINES = 80


def test_no_function_is_longer_than_a_screen():
    """Functions a screen long at most in the engine, the router and the operator: a longer one splits into
    named steps."""
    long = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"  {path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)

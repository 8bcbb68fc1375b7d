"""The import graph of the repository's own modules, and its cycles.

Every `import` and `from … import` of a first-party module counts, wherever it stands: at the
top, under `if TYPE_CHECKING:`, or inside a function. An edge goes to the module imported, or,
for `from package import name` where `name` is a submodule, to that submodule. A cycle is a
strongly connected component of more than one module (Tarjan's algorithm); the layering test
(tests/engine/test_layering.py) asserts there are none and that the engine's layers import only
downwards.

    python scripts/import_graph.py                 # cycles among engine, service, bridge, genserve, loadgen, benchmarks
    python scripts/import_graph.py --edges engine  # every edge from a module under engine
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "service", "bridge", "genserve", "loadgen", "benchmarks")


def module_files(root: pathlib.Path = ROOT, packages: tuple[str, ...] = PACKAGES
                 ) -> dict[str, pathlib.Path]:
    """Dotted module name → file, for every .py file under `packages` (a package's
    `__init__.py` is the package's own name)."""
    out = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imports_of(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """First-party modules that module `name` (at `path`) imports, anywhere in its source."""
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor if is_pkg else anchor[:-1]
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:          # `import a.b.c` where a.b.c is a name: a.b
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def import_graph(root: pathlib.Path = ROOT, packages: tuple[str, ...] = PACKAGES
                 ) -> dict[str, set[str]]:
    """Module → the first-party modules it imports."""
    modules = module_files(root, packages)
    return {m: imports_of(m, p, modules) for m, p in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module, each sorted, largest first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    sys.setrecursionlimit(10_000)

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out, key=lambda c: (-len(c), c))


def main() -> int:
    ap = argparse.ArgumentParser(description="first-party import cycles")
    ap.add_argument("--edges", metavar="PREFIX", help="print every edge from modules under PREFIX")
    a = ap.parse_args()
    graph = import_graph()
    if a.edges:
        for m in sorted(graph):
            if m == a.edges or m.startswith(a.edges + "."):
                for t in sorted(graph[m]):
                    print(f"{m} -> {t}")
        return 0
    found = cycles(graph)
    for c in found:
        print(f"cycle of {len(c)}: {' '.join(c)}")
    print(f"{len(found)} cycles among {len(graph)} modules")
    return 0


if __name__ == "__main__":
    sys.exit(main())

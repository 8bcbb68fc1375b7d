"""genserve.common is the bottom layer: no module under genserve/common/ imports engine/, service/,
bridge/, genserve.deploy or torch, anywhere in its source (at the top, under TYPE_CHECKING or inside
a function), so engine, service and bridge can all import it without a cycle and the bridge stays
torch-free."""

import ast
import pathlib

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
FORBIDDEN = ("engine", "service", "bridge", "genserve.deploy", "torch")


def _imported(path: pathlib.Path) -> set[str]:
    """Absolute module names `path` imports (relative imports resolved within genserve.common)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = ["genserve", "common"][:3 - node.level]
                base = ".".join(package + ([base] if base else []))
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def test_genserve_common_imports_no_higher_layer():
    files = sorted((REPO_ROOT / "genserve" / "common").rglob("*.py"))
    assert files
    bad = {f"{path.relative_to(REPO_ROOT)} imports {name}"
           for path in files for name in _imported(path)
           if any(name == f or name.startswith(f + ".") for f in FORBIDDEN)}
    assert not bad, sorted(bad)

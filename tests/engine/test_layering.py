"""The engine's layers, enforced: which package may import which, no import cycles, and a
scheduling core that loads without torch.

The layers, lowest first (docs/architecture.md, "Layout"):

* `engine.config`, `engine.tokenizer` (leaves) and `engine.kernels` (the C++ kernels' build);
* `engine.core`: requests, plans, the cost model, the block pool, the scheduler, the engine loop,
  the simulator's executor — no torch, nothing from the tensor side;
* `engine.structured`: constrained decoding's grammars and masks (beside the core: the request
  carries its compiled grammar as an opaque object);
* `engine.attention`: the backend interface and the backends;
* `engine.model`: the network; of attention it imports only the interface (`attention.base`);
* `engine.runner`: the model runner, its inputs and fast paths, sampling, the KV cache tensors,
  and the builder that puts everything together.

The import graph counts every import of a first-party module, at the top of a module, under
`if TYPE_CHECKING:` or inside a function (`scripts/import_graph.py`).
"""

import pathlib
import subprocess
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "scripts"))

from import_graph import cycles, import_graph  # noqa: E402  (a script, not a package)

GRAPH = import_graph(REPO_ROOT)

# package prefix → prefixes it must not import
FORBIDDEN = {
    "engine.core": ("engine.attention", "engine.model", "engine.runner", "engine.kernels",
                    "engine.structured", "service", "bridge"),
    # constrained decoding: the request carries its grammar as an opaque object
    "engine.structured": ("engine.core", "engine.attention", "engine.model", "engine.runner",
                          "service", "bridge"),
    "engine.attention": ("engine.core", "engine.model", "engine.runner", "service", "bridge"),
    "engine.model": ("engine.core", "engine.runner", "service", "bridge"),
    "engine.kernels": ("engine.core", "engine.attention", "engine.model", "engine.runner"),
    "engine.config": ("engine.core", "engine.attention", "engine.model", "engine.runner"),
    "engine": ("service", "bridge", "loadgen", "benchmarks"),
}

TORCH_FREE_MODULES = sorted(m for m in GRAPH if m == "engine.core" or m.startswith("engine.core.")) \
    + ["loadgen.sim"]

CHILD = """
import importlib, sys
for name in {modules!r}:
    importlib.import_module(name)
    if "torch" in sys.modules:
        print(name)
        break
"""


def under(module: str, prefix: str) -> bool:
    """True when `module` is the package `prefix` or inside it."""
    return module == prefix or module.startswith(prefix + ".")


def test_there_are_no_import_cycles() -> None:
    found = cycles(GRAPH)
    assert found == [], "import cycles: " + "; ".join(" ↔ ".join(c) for c in found)


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_each_layer_imports_only_below_itself(layer: str) -> None:
    bad = [f"{m} imports {t}" for m, targets in sorted(GRAPH.items()) if under(m, layer)
           for t in sorted(targets) if any(under(t, f) for f in FORBIDDEN[layer])]
    assert bad == []


def test_the_model_imports_only_the_attention_interface() -> None:
    bad = [f"{m} imports {t}" for m, targets in sorted(GRAPH.items()) if under(m, "engine.model")
           for t in sorted(targets) if under(t, "engine.attention") and t != "engine.attention.base"]
    assert bad == []


def test_only_the_models_package_names_a_family() -> None:
    """The runner, quantized and int8 weights, the decode loop, CUDA graphs, the KV cache, the
    service, tests and benchmarks talk to the shared network and its config, never to a family's
    module (the registry imports those lazily, by name)."""
    from engine.model.registry import family_modules

    families = family_modules()
    assert "engine.model.llama" in families and "engine.model.gemma3" in families
    bad = [f"{m} imports {t}" for m, targets in sorted(GRAPH.items()) if not under(m, "engine.model")
           for t in sorted(targets) if t in families]
    assert bad == []


def test_the_graph_sees_type_checking_and_function_level_imports(tmp_path) -> None:
    """The oracle itself, on a package written here: an import at the top, one under
    `if TYPE_CHECKING:` and one inside a function all show as edges; a third-party one does not."""
    package = tmp_path / "engine"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for leaf in ("top", "typed", "late"):
        (package / f"{leaf}.py").write_text("")
    (package / "user.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "import numpy\n"
        "from engine import top\n"
        "if TYPE_CHECKING:\n"
        "    from engine.typed import Thing\n"
        "def f():\n"
        "    from engine.late import g\n"
        "    return g\n")
    graph = import_graph(tmp_path, ("engine",))
    assert graph["engine.user"] == {"engine.top", "engine.typed", "engine.late"}


def test_scheduling_core_imports_without_torch() -> None:
    result = subprocess.run([sys.executable, "-c", CHILD.format(modules=TORCH_FREE_MODULES)],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"importing {result.stdout.strip()} loads torch"

"""The scheduling core and the virtual-time simulator load without torch.

The modules are imported in a fresh interpreter (this process may have torch loaded already by
other tests), one after another; the child prints the first module whose import brought `torch`
into `sys.modules`, or nothing.
"""

import pathlib
import subprocess
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]

TORCH_FREE_MODULES = (
    "engine.scheduler",
    "engine.block_pool",
    "engine.loop",
    "engine.sim_executor",
    "loadgen.sim",
)

CHILD = """
import importlib, sys
for name in {modules!r}:
    importlib.import_module(name)
    if "torch" in sys.modules:
        print(name)
        break
"""


def test_scheduling_core_imports_without_torch() -> None:
    result = subprocess.run([sys.executable, "-c", CHILD.format(modules=TORCH_FREE_MODULES)],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"importing {result.stdout.strip()} loads torch"

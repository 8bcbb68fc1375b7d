"""How `make test` splits the suite over pytest-xdist workers (tests/conftest.py): each module's
tests run on one worker, so a module's fixtures (a fleet of engines, a server) start once.

Run with the installed pytest and pytest-xdist themselves: a pytest that builds node ids in a way
pytest-xdist's `--dist loadgroup` does not follow ignores every `xdist_group` without a word (it
happened with pytest 9.2), and only a real two-worker run shows it.
"""

from __future__ import annotations

import collections
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODULES = ("tests/test_prefix_route.py", "tests/test_ports.py")


def test_each_modules_tests_run_on_one_worker_under_make_tests_options():
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup",
         "--no-loadscope-reorder", "--max-worker-restart", "0", *MODULES],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    # "[gw1] [ 12%] PASSED tests/test_ports.py::test_x@tests/test_ports.py"
    lines = re.findall(r"^\[(gw\d+)\] \[[ \d]+%\] PASSED (\S+)", run.stdout, re.M)
    workers = collections.defaultdict(set)
    for worker, nodeid in lines:
        assert "@" in nodeid, f"{nodeid}: no xdist group in the node id"
        workers[nodeid.split("::")[0]].add(worker)
    assert set(workers) == set(MODULES), run.stdout[-3000:]
    assert all(len(w) == 1 for w in workers.values()), dict(workers)
    assert sum(1 for _ in lines) >= 10

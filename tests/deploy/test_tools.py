"""scripts/tools.sh: a second run is quick, installs nothing, and reports the pinned versions;
the installed Helm and kubectl are the binaries it pins by sha256."""

from __future__ import annotations

import hashlib
import os
import pathlib
import re
import subprocess
import time

import pytest

from genserve.deploy import envoy

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = (REPO / "scripts" / "tools.sh").read_text()


@pytest.fixture(scope="module")
def installed() -> pathlib.Path:
    directory = envoy.tools_dir()
    if not (directory / ".installed").exists():
        pytest.skip(f"the tools are not installed in {directory}; run `{envoy.INSTALL_COMMAND}`")
    return directory


def test_second_run_is_quick_and_reports_every_tool(installed):
    start = time.monotonic()
    proc = subprocess.run(["bash", str(REPO / "scripts" / "tools.sh")], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "TOOLS_DIR": str(installed)})
    took = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr
    versions = dict(re.findall(r"^tools: (\S+)\s+(\S+)", proc.stdout, re.M))
    assert versions == {"envoy": "1.40.0", "helm": "v3.19.0", "kubectl": "v1.34.5",
                        "kubernetes-validate": "1.37.0"}
    assert took < 5.0
    assert "pip" not in proc.stderr


@pytest.mark.parametrize("name", ["helm", "kubectl"])
def test_binaries_match_their_pinned_sha256(installed, name):
    (pinned,) = re.findall(rf"^{name.upper()}_SHA256=([0-9a-f]{{64}})$", SCRIPT, re.M)
    assert hashlib.sha256(envoy.tool_path(name).read_bytes()).hexdigest() == pinned

"""Helpers of the deployment tests: the pinned tools, and the chart rendered in its variants.

The tools come from `bash scripts/tools.sh` (`make test` runs it first); without them every test
that needs one skips, saying which tool is missing and how to install it.
"""

from __future__ import annotations

import pathlib
import subprocess
from dataclasses import dataclass

import pytest

from genserve.deploy import envoy

CHART = envoy.CHART_DIR
GPU_VALUES = CHART / "values-gpu.yaml"
KUBERNETES_VERSION = "1.30.0"
RELEASE = "gs"
NAMESPACE = "genserve-test"
TOOL_TIMEOUT_S = 60

# The three rendered variants: default (CPU), GPU, and several replicas with monitoring on.
VARIANTS: dict[str, list[str]] = {
    "cpu": [],
    "gpu": ["-f", str(GPU_VALUES)],
    "multi": ["--set", "engine.replicas=3,bridge.replicas=2,bridge.autoscaling.enabled=true,"
              "monitoring.serviceMonitor.enabled=true,monitoring.prometheusRule.enabled=true,"
              "monitoring.grafanaDashboard.enabled=true",
              "--set-json", 'apiKeys.keys={"sk-test-1":"alice","sk-test-2":"bob"}'],
}


def tool(name: str) -> pathlib.Path:
    """A pinned tool's path; skips the test when it is not installed."""
    try:
        return envoy.tool_path(name)
    except envoy.ToolMissingError as e:
        pytest.skip(str(e))


def kubernetes_validate() -> pathlib.Path:
    """kubernetes-validate from the tools directory; skips the test when it is not installed."""
    path = envoy.tools_dir() / "bin" / "kubernetes-validate"
    if not path.exists():
        pytest.skip(f"kubernetes-validate is not installed (looked for {path}); "
                    f"install the pinned tools with `{envoy.INSTALL_COMMAND}`")
    return path


def run(cmd: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    """Run a tool, capturing its output as text (never raises on a non-zero exit)."""
    return subprocess.run([str(c) for c in cmd], input=stdin, capture_output=True, text=True,
                          timeout=TOOL_TIMEOUT_S)


def helm_template(*args: str) -> subprocess.CompletedProcess:
    """`helm template` of the chart as release RELEASE in NAMESPACE, with extra arguments."""
    return run([tool("helm"), "template", RELEASE, CHART, "--namespace", NAMESPACE,
                "--kube-version", KUBERNETES_VERSION, *args])


@dataclass
class Rendered:
    """One rendered variant: the manifest text and its objects."""

    name: str
    text: str
    objects: list[dict]

    def get(self, kind: str, component: str | None = None) -> list[dict]:
        """The objects of `kind` (and of `component`, by app.kubernetes.io/component label)."""
        return [o for o in self.objects if o["kind"] == kind and (
            component is None
            or o["metadata"].get("labels", {}).get("app.kubernetes.io/component") == component)]

    def one(self, kind: str, component: str | None = None) -> dict:
        """The single object of `kind` (and `component`); fails the test if there are 0 or 2+."""
        found = self.get(kind, component)
        assert len(found) == 1, f"{self.name}: expected one {kind} {component or ''}, got {len(found)}"
        return found[0]

    def envoy_config(self) -> str:
        """The envoy.yaml of the Envoy ConfigMap."""
        for cm in self.get("ConfigMap", "envoy"):
            return cm["data"]["envoy.yaml"]
        raise AssertionError(f"{self.name}: no Envoy ConfigMap")

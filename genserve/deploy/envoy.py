"""genserve's Envoy configuration, rendered from the Helm chart, and the pinned deployment tools.

There is one Envoy configuration: the Go template `charts/genserve/files/envoy.yaml`, which the
chart's ConfigMap (`templates/envoy-configmap.yaml`) renders. Kubernetes gets it with the chart's
Service names as upstreams; the local run (`genserve serve`) gets the same template rendered here
by the pinned Helm with loopback upstreams, so both run the same listener, routes, retries,
health checks and circuit breakers.

The tools (Envoy, Helm, kubectl) are installed by `bash scripts/tools.sh` into `.tools/bin` at
the repository root (`make test` and `make serve` run it); `GENSERVE_TOOLS_DIR` names another
tools directory (its `bin/` holds the binaries). This module never imports torch.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import tempfile
from collections.abc import Mapping, Sequence

import yaml

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]     # genserve/deploy/envoy.py
CHART_DIR = REPO_ROOT / "charts" / "genserve"
CONFIGMAP_TEMPLATE = "templates/envoy-configmap.yaml"
CONFIG_KEY = "envoy.yaml"
RELEASE_NAME = "genserve"
TOOLS = ("envoy", "helm", "kubectl")
INSTALL_COMMAND = "bash scripts/tools.sh"
DEFAULT_TIMEOUT_S = 60.0


class ToolMissingError(FileNotFoundError):
    """A pinned tool is not installed; the message says how to install it."""


class EnvoyConfigError(RuntimeError):
    """Helm could not render the configuration, or Envoy rejected it; the message holds the
    tool's own output."""


def tools_dir() -> pathlib.Path:
    """The tools directory: `$GENSERVE_TOOLS_DIR`, else `.tools` at the repository root."""
    configured = os.environ.get("GENSERVE_TOOLS_DIR")
    return pathlib.Path(configured) if configured else REPO_ROOT / ".tools"


def tool_path(name: str) -> pathlib.Path:
    """The executable of a pinned tool: "envoy", "helm" or "kubectl" (in `tools_dir()/bin`).

    Raises:
        ValueError: `name` is not one of the pinned tools.
        ToolMissingError: the tool is not installed (the message names the command to run).
    """
    if name not in TOOLS:
        raise ValueError(f"unknown tool {name!r}; the pinned tools are {', '.join(TOOLS)}")
    path = tools_dir() / "bin" / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise ToolMissingError(
            f"{name} is not installed (looked for {path}); install the pinned tools with "
            f"`{INSTALL_COMMAND}` in {REPO_ROOT}")
    return path


def _endpoints(kind: str, endpoints: Sequence[tuple[str, int]]) -> list[dict[str, object]]:
    """`[(host, port), ...]` as the chart's `[{host, port}, ...]`; raises ValueError when empty
    (the chart would fall back to Kubernetes Service names) or malformed."""
    if not endpoints:
        raise ValueError(f"{kind}: at least one (host, port) endpoint is needed")
    out = []
    for host, port in endpoints:
        if not host or not isinstance(port, int) or not 1 <= port <= 65535:
            raise ValueError(f"{kind}: bad endpoint {(host, port)!r} (a host and a port 1..65535)")
        out.append({"host": str(host), "port": port})
    return out


def _merge(base: dict, override: Mapping) -> dict:
    """`base` with `override` merged in, nested mappings merged key by key (a new dict)."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _merge(dict(merged[key]), value)
        else:
            merged[key] = value
    return merged


def render_envoy_config(*, listen_host: str, listen_port: int, admin_port: int,
                        bridge: Sequence[tuple[str, int]], engines: Sequence[tuple[str, int]],
                        extra_values: Mapping | None = None,
                        timeout_s: float = DEFAULT_TIMEOUT_S) -> str:
    """Render the chart's Envoy configuration for the given listener and upstreams.

    Runs `helm template` on charts/genserve with `--show-only templates/envoy-configmap.yaml` and
    returns the ConfigMap's `envoy.yaml` (Envoy v3 YAML). The admin interface always listens on
    127.0.0.1 (port `admin_port`).

    Args:
        listen_host: address of the public listener (REST/SSE and gRPC), e.g. "127.0.0.1".
        listen_port: its port.
        admin_port: port of Envoy's admin interface on 127.0.0.1.
        bridge: the bridges' (host, port) endpoints (cluster "bridge", HTTP/1.1).
        engines: the engines' (host, port) gRPC endpoints (cluster "engines", HTTP/2).
        extra_values: more chart values (e.g. {"envoy": {"accessLog": False}}), merged under the
            ones above; the arguments above win where both set a value.
        timeout_s: limit for the helm run, seconds.

    Raises:
        ValueError: an empty or malformed endpoint list.
        ToolMissingError: Helm is not installed.
        EnvoyConfigError: helm failed (a value the chart's schema rejects, say); the message
            holds helm's output.
    """
    values = _merge(dict(extra_values or {}), {"envoy": {
        "listen": {"host": listen_host, "port": listen_port},
        "admin": {"port": admin_port},
        "upstreams": {"bridge": _endpoints("bridge", bridge),
                      "engines": _endpoints("engines", engines)},
    }})
    helm = tool_path("helm")
    with tempfile.TemporaryDirectory(prefix="genserve-envoy-") as tmp:
        values_file = pathlib.Path(tmp) / "values.json"     # JSON is YAML: helm reads it as -f
        values_file.write_text(json.dumps(values))
        cmd = [str(helm), "template", RELEASE_NAME, str(CHART_DIR), "-f", str(values_file),
               "--show-only", CONFIGMAP_TEMPLATE]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise EnvoyConfigError(f"helm template failed (exit {proc.returncode}):\n"
                               f"{proc.stderr.strip() or proc.stdout.strip()}")
    configmap = yaml.safe_load(proc.stdout)
    if not isinstance(configmap, dict) or configmap.get("kind") != "ConfigMap" \
            or CONFIG_KEY not in configmap.get("data", {}):
        raise EnvoyConfigError(f"{CONFIGMAP_TEMPLATE} did not render a ConfigMap with {CONFIG_KEY}")
    return configmap["data"][CONFIG_KEY]


def validate_envoy_config(text: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Check a whole Envoy configuration with `envoy --mode validate` (no sockets are opened).

    Raises:
        ToolMissingError: Envoy is not installed.
        EnvoyConfigError: Envoy rejected the configuration; the message holds Envoy's output.
    """
    envoy = tool_path("envoy")
    with tempfile.TemporaryDirectory(prefix="genserve-envoy-") as tmp:
        config = pathlib.Path(tmp) / "envoy.yaml"
        config.write_text(text)
        proc = subprocess.run([str(envoy), "--mode", "validate", "--log-level", "warning",
                               "-c", str(config)], capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise EnvoyConfigError(f"envoy rejected the configuration (exit {proc.returncode}):\n"
                               f"{(proc.stderr + proc.stdout).strip()}")

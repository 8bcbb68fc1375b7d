"""The Helm chart (charts/genserve): lint, Kubernetes schema validation, and the properties the
deployment depends on, checked on the rendered objects of each variant (CPU, GPU, multi-replica
with monitoring).

kubernetes-validate has no schemas for the Prometheus Operator's CRDs (ServiceMonitor,
PrometheusRule): they are checked here by structure instead, and the alert rules by promtool.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import sys

import pytest
import yaml

from tests.deploy.helpers import (CHART, GPU_VALUES, KUBERNETES_VERSION, NAMESPACE, RELEASE,
                                   VARIANTS, helm_template, kubernetes_validate, run, tool)

REPO = pathlib.Path(__file__).resolve().parents[2]
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}
DRAIN_GRACE_S = 30                       # the engine's --drain-grace-s default (values.yaml)


# ---- lint and schema validation ---------------------------------------------------------------

@pytest.mark.parametrize("values", [[], ["-f", str(GPU_VALUES)]], ids=["cpu", "gpu"])
def test_helm_lint_strict(values):
    proc = run([tool("helm"), "lint", "--strict", CHART, *values])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_kubernetes_validate_strict(rendered, variant):
    """Every object validates against Kubernetes 1.30's schemas, unknown fields rejected; the
    only objects without a schema are the two Prometheus Operator CRDs."""
    proc = run([kubernetes_validate(), "--strict", "--kubernetes-version", KUBERNETES_VERSION, "-"],
               stdin=rendered[variant].text)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    unvalidated = re.findall(r"WARN .*Couldn't find schema for kind (\w+)", proc.stdout)
    assert set(unvalidated) <= CRD_KINDS, proc.stdout
    passed = re.findall(r"passed for resource (\S+)", proc.stdout)
    expected = [o for o in rendered[variant].objects if o["kind"] not in CRD_KINDS]
    assert len(passed) == len(expected), proc.stdout


def test_kubernetes_validate_catches_unknown_fields(rendered):
    """The validation above is not a formality: a misspelt field fails it."""
    bad = rendered["cpu"].text.replace("terminationGracePeriodSeconds:", "terminationGracePeriod:")
    proc = run([kubernetes_validate(), "--strict", "--kubernetes-version", KUBERNETES_VERSION, "-"],
               stdin=bad)
    assert proc.returncode != 0
    assert "'terminationGracePeriod' was unexpected" in proc.stdout


@pytest.mark.parametrize("override, message", [
    (["--set", "engine.replicas=-1"], "/engine/replicas"),
    (["--set-string", "engine.grpcPort=50051"], "/engine/grpcPort"),
    (["--set", "engine.profile=tpu"], "/engine/profile"),
    (["--set", "envoy.engines.lbPolicy=MAGLEV_PLEASE"], "/envoy/engines/lbPolicy"),
    # protobuf durations in the Envoy config are seconds only
    (["--set", "envoy.engines.weighted.blackoutPeriod=500ms"], "/envoy/engines/weighted/blackoutPeriod"),
    (["--set", "engine.replica=2"], "additional properties 'replica' not allowed"),
])
def test_schema_rejects_bad_values(override, message):
    proc = helm_template(*override)
    assert proc.returncode != 0
    assert "don't meet the specifications of the schema" in proc.stderr
    assert message in proc.stderr


def test_template_refuses_gpu_profile_without_model():
    proc = helm_template("--set", "engine.profile=gpu")
    assert proc.returncode != 0
    assert "set engine.model.path" in proc.stderr


# ---- the engine -------------------------------------------------------------------------------

def engine_container(r) -> dict:
    (container,) = r.one("Deployment", "engine")["spec"]["template"]["spec"]["containers"]
    return container


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_engine_probes_are_grpc_health(rendered, variant):
    container = engine_container(rendered[variant])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"] == {"port": 50051}, probe
    # The startup probe allows for the weight load: minutes, not the liveness probe's seconds.
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
    assert {"name": "grpc", "containerPort": 50051, "protocol": "TCP"} in container["ports"]
    assert {"name": "metrics", "containerPort": 9400, "protocol": "TCP"} in container["ports"]
    assert "--metrics-port=9400" in container["args"]


def test_gpu_startup_probe_is_longer(rendered):
    cpu = engine_container(rendered["cpu"])["startupProbe"]
    gpu = engine_container(rendered["gpu"])["startupProbe"]
    assert gpu["periodSeconds"] * gpu["failureThreshold"] == 600
    assert cpu["periodSeconds"] * cpu["failureThreshold"] == 300


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_engine_termination_outlasts_drain(rendered, variant):
    deployment = rendered[variant].one("Deployment", "engine")
    pod = deployment["spec"]["template"]["spec"]
    container = engine_container(rendered[variant])
    assert f"--drain-grace-s={DRAIN_GRACE_S}" in container["args"]
    sleep_s = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    assert container["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    assert sleep_s >= 1
    # SIGKILL comes after the preStop sleep plus the whole drain, with room to spare.
    assert pod["terminationGracePeriodSeconds"] == sleep_s + DRAIN_GRACE_S + 15


def test_termination_grace_follows_drain_grace():
    proc = helm_template("--set", "engine.drainGraceSeconds=120", "--show-only",
                         "templates/engine-deployment.yaml")
    assert proc.returncode == 0, proc.stderr
    deployment = yaml.safe_load(proc.stdout)
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 5 + 120 + 15
    assert "--drain-grace-s=120" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_engine_resources_and_security(rendered, variant):
    r = rendered[variant]
    pod = r.one("Deployment", "engine")["spec"]["template"]["spec"]
    container = engine_container(r)
    assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]
    assert container["resources"]["limits"]["memory"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    # The writable places: /tmp and the torch extensions cache, both emptyDirs.
    env = {e["name"]: e.get("value") for e in container["env"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]
    assert "emptyDir" in volumes[mounts[env["TORCH_EXTENSIONS_DIR"]]]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_api_keys_come_from_a_secret(rendered, variant):
    r = rendered[variant]
    pod = r.one("Deployment", "engine")["spec"]["template"]["spec"]
    container = engine_container(r)
    env = {e["name"]: e.get("value") for e in container["env"]}
    keys_file = pathlib.PurePosixPath(env["GENSERVE_API_KEYS_FILE"])
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(keys_file.parent)]
    assert mount["readOnly"] is True
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["items"][0]["path"] == keys_file.name
    secret = r.one("Secret")
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    keys = json.loads(secret["stringData"][volume["secret"]["items"][0]["key"]])
    assert keys == ({"sk-test-1": "alice", "sk-test-2": "bob"} if variant == "multi" else {})


def test_existing_api_keys_secret_is_used_as_is():
    proc = helm_template("--set", "apiKeys.existingSecret=prod-keys,apiKeys.secretKey=keys")
    assert proc.returncode == 0, proc.stderr
    objects = [o for o in yaml.safe_load_all(proc.stdout) if o]
    assert not [o for o in objects if o["kind"] == "Secret"]
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"
                     and o["metadata"]["name"].endswith("-engine")]
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["api-keys"]["secret"] == {"secretName": "prod-keys",
                                             "items": [{"key": "keys", "path": "keys.json"}]}


def test_gpu_profile(rendered):
    gpu, cpu = rendered["gpu"], rendered["cpu"]
    container = engine_container(gpu)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert "--model=/models/llama-2-7b.f16.gguf" in container["args"]
    assert "engine-cuda" in container["image"]
    pod = gpu.one("Deployment", "engine")["spec"]["template"]["spec"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["model"]["mountPath"] == "/models" and mounts["model"]["readOnly"] is True
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"]["claimName"] == "genserve-models"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    # The CPU profile asks for no GPU and loads the embedded model.
    cpu_container = engine_container(cpu)
    assert "nvidia.com/gpu" not in cpu_container["resources"]["limits"]
    assert not [a for a in cpu_container["args"] if a.startswith("--model")]
    assert "engine-cpu" in cpu_container["image"]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_engine_service_is_headless(rendered, variant):
    r = rendered[variant]
    service = r.one("Service", "engine")
    assert service["spec"]["clusterIP"] == "None"
    pod_labels = r.one("Deployment", "engine")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"grpc": 50051, "metrics": 9400}


def test_replica_counts(rendered):
    multi = rendered["multi"]
    assert multi.one("Deployment", "engine")["spec"]["replicas"] == 3
    # With the HPA on, the HPA owns the bridge's replica count.
    assert "replicas" not in multi.one("Deployment", "bridge")["spec"]
    hpa = multi.one("HorizontalPodAutoscaler", "bridge")
    assert hpa["spec"]["scaleTargetRef"]["name"] == multi.one("Deployment", "bridge")["metadata"]["name"]
    assert rendered["cpu"].one("Deployment", "bridge")["spec"]["replicas"] == 2
    assert not rendered["cpu"].get("HorizontalPodAutoscaler")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_network_policy_admits_only_envoy_and_bridge(rendered, variant):
    r = rendered[variant]
    policy = r.one("NetworkPolicy", "engine")
    engine_labels = r.one("Deployment", "engine")["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= engine_labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    grpc_rules = [rule for rule in policy["spec"]["ingress"]
                  if {"port": "grpc", "protocol": "TCP"} in rule["ports"]]
    assert len(grpc_rules) == 1
    peers = grpc_rules[0]["from"]
    assert all(set(p) == {"podSelector"} for p in peers)            # same namespace, no IP blocks
    components = sorted(p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in peers)
    assert components == ["bridge", "envoy"]
    for peer in peers:
        component = peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
        labels = r.one("Deployment", component)["spec"]["template"]["metadata"]["labels"]
        assert peer["podSelector"]["matchLabels"].items() <= labels.items()
    # Metrics: the only other rule, on the metrics port alone.
    others = [rule for rule in policy["spec"]["ingress"] if rule is not grpc_rules[0]]
    assert [rule["ports"] for rule in others] == [[{"port": "metrics", "protocol": "TCP"}]]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_disruption_budgets(rendered, variant):
    r = rendered[variant]
    for component in ("engine", "bridge", "envoy"):
        pdb = r.one("PodDisruptionBudget", component)
        labels = r.one("Deployment", component)["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert pdb["spec"]["maxUnavailable"] == 1


# ---- bridge and Envoy ---------------------------------------------------------------------------

@pytest.mark.parametrize("variant", list(VARIANTS))
def test_bridge_calls_engines_through_envoy(rendered, variant):
    r = rendered[variant]
    (container,) = r.one("Deployment", "bridge")["spec"]["template"]["spec"]["containers"]
    envoy_service = r.one("Service", "envoy")
    assert f"--grpc-target={envoy_service['metadata']['name']}:8000" in container["args"]
    assert "--host=0.0.0.0" in container["args"] and "--port=8080" in container["args"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert r.one("Service", "bridge")["spec"]["ports"][0]["port"] == 8080


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_envoy_deployment_mounts_its_config(rendered, variant):
    r = rendered[variant]
    deployment = r.one("Deployment", "envoy")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "envoyproxy/envoy:v1.40.0"
    assert "--config-path=/etc/envoy/envoy.yaml" in container["args"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    configmap = r.one("ConfigMap", "envoy")
    assert volumes["config"]["configMap"]["name"] == configmap["metadata"]["name"]
    assert r.one("Service", "envoy")["spec"]["ports"] == [
        {"name": "public", "port": 8000, "targetPort": "public", "protocol": "TCP"}]
    assert re.fullmatch(r"[0-9a-f]{64}", deployment["spec"]["template"]["metadata"]["annotations"]
                        ["checksum/config"])


# ---- monitoring -------------------------------------------------------------------------------

def defined_metric_names() -> set[str]:
    """Metric names genserve exports, read from the sources (service/metrics.py, bridge/metrics.py),
    with the suffixes Prometheus adds (_total for counters, _bucket/_sum/_count for histograms)."""
    names = set()
    for path in (REPO / "service" / "metrics.py", REPO / "bridge" / "metrics.py"):
        source = path.read_text()
        for kind, name in re.findall(r'(Histogram|Counter|CounterMetricFamily|GaugeMetricFamily)'
                                     r'\(\s*"(genserve_\w+)"', source):
            if kind == "Histogram":
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
            elif kind.startswith("Counter"):
                names.add(f"{name}_total")
        # The scheduler gauges are declared as a table of (name, doc, value) tuples.
        names |= set(re.findall(r'\(\s*"(genserve_\w+)",\s*"[^"]*",\s*s\.\w+\)', source))
    return names


def referenced_metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b(genserve_\w+)", expr))


def test_metric_names_are_read_from_the_sources():
    names = defined_metric_names()
    assert {"genserve_queue_depth", "genserve_queued_device_seconds", "genserve_kv_blocks_free",
            "genserve_max_token_gap_seconds_bucket", "genserve_requests_rejected_total",
            "genserve_preemptions_total", "genserve_bridge_http_responses_total"} <= names


def test_service_monitors(rendered):
    multi = rendered["multi"]
    monitors = {m["metadata"]["labels"]["app.kubernetes.io/component"]: m
                for m in multi.get("ServiceMonitor")}
    assert set(monitors) == {"engine", "bridge"}
    for component, port in (("engine", "metrics"), ("bridge", "http")):
        spec = monitors[component]["spec"]
        assert monitors[component]["apiVersion"] == "monitoring.coreos.com/v1"
        service = multi.one("Service", component)
        assert spec["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        assert port in [p["name"] for p in service["spec"]["ports"]]
        assert spec["endpoints"] == [{"port": port, "path": "/metrics", "interval": "15s"}]
        assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert not rendered["cpu"].get("ServiceMonitor") and not rendered["cpu"].get("PrometheusRule")


def test_prometheus_rule_alerts(rendered, tmp_path):
    rule = rendered["multi"].one("PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    rules = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert set(rules) >= {"GenserveTokenGapP99High", "GenserveRejecting429", "GenserveKVBlocksLow",
                          "GenserveEngineRestarts", "GenserveQueuedDeviceSecondsNearBudget"}
    known = defined_metric_names()
    for name, r in rules.items():
        assert referenced_metric_names(r["expr"]) <= known, name
        assert f'job="{RELEASE}-genserve-engine"' in r["expr"] or "kube_pod_container" in r["expr"]
    assert "genserve_max_token_gap_seconds_bucket" in rules["GenserveTokenGapP99High"]["expr"]
    assert '> 1.6' in rules["GenserveQueuedDeviceSecondsNearBudget"]["expr"]   # 0.8 × the 2 s budget
    assert '0.05 * genserve_kv_blocks_capacity' in rules["GenserveKVBlocksLow"]["expr"]
    assert 'code="429"' in rules["GenserveRejecting429"]["expr"]
    promtool = shutil.which("promtool") or str(pathlib.Path(sys.executable).parent / "promtool")
    if not pathlib.Path(promtool).exists():
        pytest.skip("promtool is not installed (scripts/bootstrap.sh copies it into the venv)")
    rules_file = tmp_path / "rules.yaml"
    rules_file.write_text(yaml.safe_dump(rule["spec"]))
    proc = run([promtool, "check", "rules", rules_file])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(rules)} rules found" in proc.stdout


def test_grafana_dashboard(rendered, tmp_path):
    (configmap,) = [c for c in rendered["multi"].get("ConfigMap")
                    if c["metadata"]["labels"].get("grafana_dashboard") == "1"]
    dashboard = json.loads(configmap["data"]["genserve.json"])
    exprs = {p["title"]: [t["expr"] for t in p["targets"]] for p in dashboard["panels"]}
    referenced = set().union(*(referenced_metric_names(e) for es in exprs.values() for e in es))
    assert referenced <= defined_metric_names()
    assert {"genserve_ttft_seconds_bucket", "genserve_tpot_seconds_bucket",
            "genserve_max_token_gap_seconds_bucket", "genserve_queue_depth",
            "genserve_queued_device_seconds", "genserve_running_rows", "genserve_kv_blocks_free",
            "genserve_requests_rejected_total", "genserve_preemptions_total",
            "genserve_cancelled_tokens_total", "genserve_generated_tokens_total",
            "genserve_prefix_cache_hit_tokens_total", "genserve_prefix_cache_queried_tokens_total"} <= referenced
    # the hit ratio per replica: a pod in Kubernetes, a `replica` label behind `genserve serve`
    (ratio, overall) = exprs["Prefix-cache hit ratio by replica"]
    assert "sum by (pod, replica)" in ratio and " / " in ratio and " / " in overall
    latency = [e for es in exprs.values() for e in es if "histogram_quantile(0.95" in e]
    assert len(latency) == 3 and all("prompt_bucket" in e for e in latency)
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    # Every panel query parses as PromQL: promtool checks them as recording rules.
    promtool = shutil.which("promtool") or str(pathlib.Path(sys.executable).parent / "promtool")
    if not pathlib.Path(promtool).exists():
        pytest.skip("promtool is not installed (scripts/bootstrap.sh copies it into the venv)")
    records = [{"record": f"panel:check:{i}",
                "expr": e.replace("$__rate_interval", "5m").replace("$namespace", "default")}
               for i, e in enumerate(e for es in exprs.values() for e in es)]
    rules_file = tmp_path / "panels.yaml"
    rules_file.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": records}]}))
    proc = run([promtool, "check", "rules", rules_file])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_monitoring_is_off_by_default(rendered):
    kinds = {o["kind"] for o in rendered["cpu"].objects}
    assert kinds == {"Deployment", "Service", "ConfigMap", "Secret", "PodDisruptionBudget",
                     "NetworkPolicy"}
    assert not [c for c in rendered["cpu"].get("ConfigMap")
                if c["metadata"]["labels"].get("grafana_dashboard")]


# ---- images -------------------------------------------------------------------------------------

def test_bridge_image_requirements_match_pyproject():
    """docker/Dockerfile.bridge installs the bridge's dependencies by hand (the project's own would
    pull torch): each must be one of pyproject.toml's dependencies, with the same specifier."""
    import tomllib

    declared = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"])
    dockerfile = (REPO / "docker" / "Dockerfile.bridge").read_text()
    installed = re.findall(r'"([A-Za-z][\w.\-\[\]]*[<>=~!]=?[^"]+)"', dockerfile)
    assert len(installed) >= 8
    assert set(installed) <= declared, set(installed) - declared
    assert not [r for r in installed if r.startswith("torch")]

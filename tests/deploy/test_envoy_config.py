"""The one Envoy configuration (charts/genserve/files/envoy.yaml): every rendered variant passes
`envoy --mode validate`, and its routes, retries, health checks and limits are the ones the
deployment relies on. genserve.deploy.envoy renders the same template for the local loopback layout.
"""

from __future__ import annotations

import pytest
import yaml

from engine.config import EngineConfig
from genserve.deploy import cli, envoy
from tests.deploy.helpers import NAMESPACE, RELEASE, VARIANTS, helm_template, tool

LOCAL = dict(listen_host="127.0.0.1", listen_port=8000, admin_port=9901,
             bridge=[("127.0.0.1", 8001)], engines=[("127.0.0.1", 50061), ("127.0.0.1", 50062)])


@pytest.fixture(scope="module")
def local_config() -> str:
    tool("helm")
    return envoy.render_envoy_config(**LOCAL)


def parse(text: str) -> dict:
    return yaml.safe_load(text)


def cluster(config: dict, name: str) -> dict:
    (found,) = [c for c in config["static_resources"]["clusters"] if c["name"] == name]
    return found


def hcm(config: dict) -> dict:
    (listener,) = config["static_resources"]["listeners"]
    (chain,) = listener["filter_chains"]
    (manager,) = chain["filters"]
    assert manager["name"] == "envoy.filters.network.http_connection_manager"
    return manager["typed_config"]


def routes(config: dict) -> dict[str, dict]:
    (vhost,) = hcm(config)["route_config"]["virtual_hosts"]
    return {r["name"]: r for r in vhost["routes"]}


def endpoints(c: dict) -> list[tuple[str, int]]:
    return [(e["endpoint"]["address"]["socket_address"]["address"],
             e["endpoint"]["address"]["socket_address"]["port_value"])
            for group in c["load_assignment"]["endpoints"] for e in group["lb_endpoints"]]


# ---- envoy --mode validate ----------------------------------------------------------------------

@pytest.mark.parametrize("variant", list(VARIANTS))
def test_rendered_configmap_validates(rendered, variant):
    tool("envoy")
    envoy.validate_envoy_config(rendered[variant].envoy_config())


def test_local_layout_validates(local_config):
    tool("envoy")
    envoy.validate_envoy_config(local_config)


def test_validate_reports_envoys_error(local_config):
    tool("envoy")
    with pytest.raises(envoy.EnvoyConfigError, match="unknown enum value: 'MOST_REQUEST'"):
        envoy.validate_envoy_config(local_config.replace("LEAST_REQUEST", "MOST_REQUEST", 1))


# ---- genserve.deploy.envoy --------------------------------------------------------------------------

def test_local_layout_has_loopback_endpoints(local_config):
    config = parse(local_config)
    assert endpoints(cluster(config, "engines")) == LOCAL["engines"]
    assert endpoints(cluster(config, "bridge")) == LOCAL["bridge"]
    (listener,) = config["static_resources"]["listeners"]
    assert listener["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 8000}
    assert config["admin"]["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 9901}


def test_extra_values_reach_the_template():
    tool("helm")
    text = envoy.render_envoy_config(**LOCAL, extra_values={"envoy": {
        "accessLog": False, "engines": {"lbPolicy": "ROUND_ROBIN"}, "listen": {"port": 1}}})
    config = parse(text)
    assert cluster(config, "engines")["lb_policy"] == "ROUND_ROBIN"
    assert "access_log" not in hcm(config)
    # The explicit arguments win over extra_values.
    assert config["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"] == 8000


def test_render_rejects_what_the_chart_schema_rejects():
    tool("helm")
    with pytest.raises(envoy.EnvoyConfigError, match="/envoy/admin/port"):
        envoy.render_envoy_config(**{**LOCAL, "admin_port": 70000})


@pytest.mark.parametrize("bad", [{"engines": []}, {"bridge": [("", 8001)]},
                                 {"engines": [("127.0.0.1", 0)]}])
def test_render_rejects_bad_endpoints(bad):
    with pytest.raises(ValueError):
        envoy.render_envoy_config(**{**LOCAL, **bad})


def test_missing_tool_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setenv("GENSERVE_TOOLS_DIR", str(tmp_path))
    with pytest.raises(envoy.ToolMissingError, match="bash scripts/tools.sh") as err:
        envoy.render_envoy_config(**LOCAL)
    assert str(tmp_path / "bin" / "helm") in str(err.value)
    with pytest.raises(envoy.ToolMissingError, match="envoy is not installed"):
        envoy.validate_envoy_config("admin: {}")
    with pytest.raises(ValueError, match="unknown tool"):
        envoy.tool_path("docker")


def test_tool_path_follows_genserve_tools_dir(tmp_path, monkeypatch):
    (tmp_path / "bin").mkdir()
    fake = tmp_path / "bin" / "kubectl"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("GENSERVE_TOOLS_DIR", str(tmp_path))
    assert envoy.tool_path("kubectl") == fake


# ---- what the configuration says --------------------------------------------------------------------

@pytest.fixture(scope="module", params=["kubernetes", "local"])
def config(request, rendered, local_config) -> dict:
    return parse(rendered["cpu"].envoy_config() if request.param == "kubernetes" else local_config)


def test_kubernetes_upstreams_are_the_charts_services(rendered):
    config = parse(rendered["multi"].envoy_config())
    domain = f"{NAMESPACE}.svc.cluster.local"
    assert endpoints(cluster(config, "engines")) == [(f"{RELEASE}-genserve-engine.{domain}", 50051)]
    assert endpoints(cluster(config, "bridge")) == [(f"{RELEASE}-genserve-bridge.{domain}", 8080)]
    (listener,) = config["static_resources"]["listeners"]
    assert listener["address"]["socket_address"] == {"address": "0.0.0.0", "port_value": 8000}


def test_admin_listens_on_loopback_only(config):
    assert config["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"


def test_one_listener_codec_auto_and_stream_timeouts(config):
    manager = hcm(config)
    assert manager["codec_type"] == "AUTO"
    # a queued request's stream is silent until its first token: Envoy must not reset it before
    # the engine's own deadline ends it
    assert float(manager["stream_idle_timeout"].removesuffix("s")) > EngineConfig().default_deadline_s
    assert manager["request_timeout"] == "0s"
    # Only the router: no buffer filter, no compressor (SSE and gRPC stream through).
    assert [f["name"] for f in manager["http_filters"]] == ["envoy.filters.http.router"]


def test_routes_split_grpc_from_rest(config):
    r = routes(config)
    assert list(r) == ["cancel", "affinity", "grpc", "rest"]   # order matters: first match wins
    assert r["cancel"]["match"]["path"] == "/genserve.v1.GenerateService/Cancel"
    assert r["cancel"]["route"]["cluster"] == "engines"
    assert r["grpc"]["match"]["headers"] == [
        {"name": "content-type", "string_match": {"prefix": "application/grpc"}}]
    assert r["grpc"]["match"]["prefix"] == "/"
    assert r["grpc"]["route"]["cluster"] == "engines"
    assert r["rest"]["match"] == {"prefix": "/"}
    assert r["rest"]["route"]["cluster"] == "bridge"
    for route in r.values():
        assert route["route"]["timeout"] == "0s"


def _first_route(config: dict, path: str, content_type: str) -> str:
    """The name of the first route whose match takes a request (path, content-type), as Envoy
    picks it: exact `path` or `prefix`, then every header's string prefix."""
    for name, route in routes(config).items():
        match = route["match"]
        if "path" in match and match["path"] != path:
            continue
        if "prefix" in match and not path.startswith(match["prefix"]):
            continue
        if any(h["name"] != "content-type" for h in match.get("headers", [])):
            continue                     # a header these requests do not carry (the routing key)
        if all(content_type.startswith(h["string_match"]["prefix"]) for h in match.get("headers", [])
               if h["name"] == "content-type"):
            return name
    raise AssertionError(f"no route takes {path}")


@pytest.mark.parametrize("path, content_type, route", [
    ("/tokenize", "application/json", "rest"),
    ("/detokenize", "application/json", "rest"),
    ("/v1/models/SmolLM2-135M-Instruct", "", "rest"),
    ("/genserve.v1.GenerateService/Tokenize", "application/grpc", "grpc"),
    ("/genserve.v1.GenerateService/Detokenize", "application/grpc", "grpc"),
])
def test_openai_parity_endpoints_route_like_the_others(config, path, content_type, route):
    """vLLM's /tokenize and /detokenize and the model retrieve reach the bridge; the Tokenize and
    Detokenize RPCs reach the engines (any replica can answer them)."""
    assert _first_route(config, path, content_type) == route
    assert routes(config)[route]["route"]["cluster"] == ("bridge" if route == "rest" else "engines")


def test_retries_only_where_safe(config):
    r = routes(config)
    grpc = r["grpc"]["route"]["retry_policy"]
    assert grpc["retry_on"].split(",") == ["resource-exhausted", "unavailable", "connect-failure",
                                           "refused-stream"]
    assert grpc["num_retries"] == 1
    assert grpc["host_selection_retry_max_attempts"] == 5
    assert [p["name"] for p in grpc["retry_host_predicate"]] == ["envoy.retry_host_predicates.previous_hosts"]
    rest = r["rest"]["route"]["retry_policy"]
    assert rest["retry_on"].split(",") == ["connect-failure", "refused-stream"]
    # Cancel sweeps the replicas: NOT_FOUND (grpc-status 5 in a trailers-only answer) is retried on
    # a replica not tried yet; Cancel of an unknown id changes nothing, so this is safe.
    cancel = r["cancel"]["route"]["retry_policy"]
    assert cancel["retry_on"].split(",") == ["retriable-headers", "unavailable", "connect-failure",
                                             "refused-stream"]
    assert cancel["retriable_headers"] == [{"name": "grpc-status", "string_match": {"exact": "5"}}]
    assert cancel["num_retries"] == 7
    assert cancel["host_selection_retry_max_attempts"] == 8     # see the template: two random picks
    assert [p["name"] for p in cancel["retry_host_predicate"]] == \
        ["envoy.retry_host_predicates.previous_hosts"]
    assert rest["num_retries"] == 1


def test_engines_cluster(config):
    c = cluster(config, "engines")
    assert c["lb_policy"] == "LEAST_REQUEST"
    assert c["cluster_type"]["name"] == "envoy.clusters.dns"
    assert c["cluster_type"]["typed_config"]["all_addresses_in_single_endpoint"] is False   # strict
    protocol = c["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert "http2_protocol_options" in protocol["explicit_http_config"]
    (hc,) = c["health_checks"]
    assert hc["grpc_health_check"] == {"service_name": "genserve.v1.GenerateService"}
    assert (hc["interval"], hc["timeout"], hc["unhealthy_threshold"], hc["healthy_threshold"]) == \
        ("0.5s", "1s", 2, 1)
    assert hc["no_traffic_interval"] == "1s"
    assert c["common_lb_config"]["update_merge_window"] == "0s"   # health reaches workers at once
    outlier = c["outlier_detection"]
    assert outlier["consecutive_gateway_failure"] == 3
    assert outlier["enforcing_consecutive_gateway_failure"] == 100
    assert outlier["enforcing_consecutive_5xx"] == 0
    (thresholds,) = c["circuit_breakers"]["thresholds"]
    assert thresholds["retry_budget"] == {"budget_percent": {"value": 20}, "min_retry_concurrency": 3}


def test_affinity_route_hashes_the_prefix_key(config):
    """gRPC calls with the prefix routing key go to the hashing cluster, hashed on that header,
    retried as the grpc route retries (refusals before the first message, on another replica);
    Cancel is matched first and never hashed (its sweep needs least request's re-picks)."""
    r = routes(config)
    affinity = r["affinity"]
    assert affinity["match"]["prefix"] == "/"
    assert affinity["match"]["headers"] == [
        {"name": "content-type", "string_match": {"prefix": "application/grpc"}},
        {"name": "x-genserve-prefix-key", "present_match": True}]
    assert affinity["route"]["cluster"] == "engines_affinity"
    assert affinity["route"]["hash_policy"] == [{"header": {"header_name": "x-genserve-prefix-key"}}]
    assert affinity["route"]["retry_policy"] == r["grpc"]["route"]["retry_policy"]
    assert list(r).index("cancel") < list(r).index("affinity")


def test_affinity_cluster_is_the_engines_with_bounded_load_hashing(config):
    """The same replicas, health checks, ejection and limits as "engines"; Maglev with a hash
    balance factor of 125 % (a replica past 1.25 × the mean active requests sheds new keys)."""
    engines, affinity = cluster(config, "engines"), cluster(config, "engines_affinity")
    assert affinity["lb_policy"] == "MAGLEV"
    assert affinity["common_lb_config"]["consistent_hashing_lb_config"] == {"hash_balance_factor": 125}
    assert endpoints(affinity) == endpoints(engines)
    assert affinity["load_assignment"]["cluster_name"] == "engines_affinity"
    for key in ("health_checks", "outlier_detection", "circuit_breakers", "typed_extension_protocol_options",
                "cluster_type", "connect_timeout"):
        assert affinity[key] == engines[key], key
    assert {k: v for k, v in affinity["common_lb_config"].items() if k != "consistent_hashing_lb_config"} \
        == engines["common_lb_config"]


WEIGHTED = "CLIENT_SIDE_WEIGHTED_ROUND_ROBIN"
CSWRR_TYPE = ("type.googleapis.com/envoy.extensions.load_balancing_policies."
              "client_side_weighted_round_robin.v3.ClientSideWeightedRoundRobin")


def weighted_policy(c: dict) -> dict:
    """The typed config of a cluster's client-side weighted round robin (fails if it has none)."""
    assert "lb_policy" not in c          # load_balancing_policy replaces it
    (policy,) = c["load_balancing_policy"]["policies"]
    extension = policy["typed_extension_config"]
    assert extension["name"] == "envoy.load_balancing_policies.client_side_weighted_round_robin"
    return extension["typed_config"]


def test_weighted_fallback_is_envoys_client_side_weighted_round_robin():
    """envoy.engines.lbPolicy CLIENT_SIDE_WEIGHTED_ROUND_ROBIN: the engines cluster weighs the
    replicas by their load reports with the chart's timing (2 s blackout, weights recomputed every
    0.5 s, dropped after 60 s without a report); the hashing cluster keeps Maglev; Envoy takes it."""
    tool("envoy")
    tool("helm")
    text = envoy.render_envoy_config(**LOCAL, extra_values={"envoy": {"engines": {"lbPolicy": WEIGHTED}}})
    envoy.validate_envoy_config(text)
    config = parse(text)
    assert weighted_policy(cluster(config, "engines")) == {
        "@type": CSWRR_TYPE, "blackout_period": "2s", "weight_update_period": "0.5s",
        "weight_expiration_period": "60s"}
    assert cluster(config, "engines_affinity")["lb_policy"] == "MAGLEV"
    assert "load_balancing_policy" not in cluster(config, "engines_affinity")
    # the rest of the cluster (health checks, ejection, limits) is the least-request one's
    default = cluster(parse(envoy.render_envoy_config(**LOCAL)), "engines")
    assert {k: v for k, v in cluster(config, "engines").items() if k != "load_balancing_policy"} == \
        {k: v for k, v in default.items() if k != "lb_policy"}


def test_weighted_fallback_in_the_chart_validates():
    """The Kubernetes rendering with the weighted fallback and other timing passes Envoy's check."""
    tool("envoy")
    proc = helm_template("--set", f"envoy.engines.lbPolicy={WEIGHTED}",
                         "--set", "envoy.engines.weighted.blackoutPeriod=5s",
                         "--set", "envoy.engines.weighted.weightUpdatePeriod=1s")
    assert proc.returncode == 0, proc.stderr
    (configmap,) = [o for o in yaml.safe_load_all(proc.stdout) if o and o["kind"] == "ConfigMap"
                    and o["metadata"]["name"].endswith("-envoy")]
    text = configmap["data"]["envoy.yaml"]
    envoy.validate_envoy_config(text)
    policy = weighted_policy(cluster(parse(text), "engines"))
    assert (policy["blackout_period"], policy["weight_update_period"]) == ("5s", "1s")


def test_genserve_serve_lb_policy_can_be_weighted():
    tool("envoy")
    tool("helm")
    args = cli.build_parser().parse_args(
        ["serve", "--port", "18000", "--grpc-port", "18051", "--bridge-port", "18100",
         "--envoy-admin-port", "18200", "--replicas", "2", "--lb-policy", WEIGHTED])
    config = parse(cli.envoy_config(args))
    assert weighted_policy(cluster(config, "engines"))["@type"] == CSWRR_TYPE


def test_affinity_can_be_turned_off():
    """envoy.engines.affinity.enabled=false: no affinity route or cluster; every gRPC call is
    balanced by the engines cluster's policy, routing key or not."""
    tool("helm")
    config = parse(envoy.render_envoy_config(
        **LOCAL, extra_values={"envoy": {"engines": {"affinity": {"enabled": False}}}}))
    assert list(routes(config)) == ["cancel", "grpc", "rest"]
    assert [c["name"] for c in config["static_resources"]["clusters"]] == ["engines", "bridge"]


def test_envoy_closes_idle_bridge_connections_before_the_bridge_does(config):
    """Envoy's idle timeout for the bridge cluster is below the bridge's keep-alive, so Envoy never
    reuses a connection the bridge is closing (a reset before any header, a 503 to the client)."""
    from bridge.server import KEEP_ALIVE_S

    protocol = cluster(config, "bridge")["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    idle = protocol["common_http_protocol_options"]["idle_timeout"]
    assert idle.endswith("s") and float(idle[:-1]) < KEEP_ALIVE_S


def test_bridge_cluster_never_ejects_on_answers(config):
    """A bridge's 503 (engines down) must reach the client: only connection failures eject."""
    c = cluster(config, "bridge")
    protocol = c["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert "http_protocol_options" in protocol["explicit_http_config"]
    assert "health_checks" not in c
    outlier = c["outlier_detection"]
    assert outlier["split_external_local_origin_errors"] is True
    assert outlier["enforcing_consecutive_5xx"] == 0
    assert outlier["enforcing_consecutive_gateway_failure"] == 0
    assert outlier["enforcing_success_rate"] == 0


def test_envoys_own_503s_carry_retry_after(config):
    (mapper,) = hcm(config)["local_reply_config"]["mappers"]
    assert mapper["filter"]["status_code_filter"]["comparison"]["value"]["default_value"] == 503
    assert mapper["headers_to_add"][0]["header"] == {"key": "retry-after", "value": "1"}


# ---- genserve serve's configuration -----------------------------------------------------------------

@pytest.mark.parametrize("replicas, grpc_retries", [(1, 0), (3, 1)])
def test_genserve_serve_renders_a_valid_config_for_its_layout(replicas, grpc_retries):
    """`genserve serve` fronts its processes with the chart's template: the public listener on
    --host:--port, the bridge and the replicas on loopback, admin on loopback, validated. A refused
    gRPC call is retried only where another replica exists."""
    tool("envoy")
    tool("helm")
    args = cli.build_parser().parse_args(
        ["serve", "--host", "0.0.0.0", "--port", "18000", "--grpc-port", "18051", "--bridge-port", "18100",
         "--envoy-admin-port", "18200", "--replicas", str(replicas), "--lb-policy", "ROUND_ROBIN"])
    config = parse(cli.envoy_config(args))
    assert config["admin"]["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 18200}
    (listener,) = config["static_resources"]["listeners"]
    assert listener["address"]["socket_address"] == {"address": "0.0.0.0", "port_value": 18000}
    assert endpoints(cluster(config, "bridge")) == [("127.0.0.1", 18100)]
    engines = cluster(config, "engines")
    assert endpoints(engines) == [("127.0.0.1", 18051 + i) for i in range(replicas)]
    assert engines["lb_policy"] == "ROUND_ROBIN"
    r = routes(config)
    assert r["grpc"]["route"]["retry_policy"]["num_retries"] == grpc_retries
    assert r["cancel"]["route"]["retry_policy"]["num_retries"] == 7
    assert "access_log" not in hcm(config)


def test_genserve_serve_flags_set_prefix_affinity():
    """--hash-balance-factor reaches the hashing cluster; --no-prefix-affinity renders none."""
    tool("envoy")
    tool("helm")
    base = ["serve", "--port", "18000", "--grpc-port", "18051", "--bridge-port", "18100",
            "--envoy-admin-port", "18200", "--replicas", "2"]
    config = parse(cli.envoy_config(cli.build_parser().parse_args(base)))
    assert cluster(config, "engines_affinity")["common_lb_config"]["consistent_hashing_lb_config"] == \
        {"hash_balance_factor": 125}
    config = parse(cli.envoy_config(cli.build_parser().parse_args([*base, "--hash-balance-factor", "150"])))
    assert cluster(config, "engines_affinity")["common_lb_config"]["consistent_hashing_lb_config"] == \
        {"hash_balance_factor": 150}
    config = parse(cli.envoy_config(cli.build_parser().parse_args([*base, "--no-prefix-affinity"])))
    assert "affinity" not in routes(config)
    assert "engines_affinity" not in [c["name"] for c in config["static_resources"]["clusters"]]

"""`genserve serve`: Envoy, the bridge (REST+SSE) and the engine replicas (gRPC) on localhost, supervised.

Layout (the Kubernetes deployment's, on one machine):

    client -> Envoy (--host:--port; REST+SSE and gRPC on one port)
                 REST+SSE -> bridge (127.0.0.1:--bridge-port) -> Envoy -> engines
                 gRPC     -> engines (127.0.0.1:--grpc-port + i, i < --replicas)

Envoy's configuration is the Helm chart's one template (`charts/genserve/files/envoy.yaml`),
rendered by `genserve.deploy.envoy` with loopback upstreams: the same routes, retries, health checks
(a killed or draining replica leaves rotation within about 2 s) and Cancel sweep across replicas.
With several replicas, completions carry the bridge's prefix routing key and Envoy places them by
consistent hashing with bounded load (`--prefix-affinity`, on by default), so a conversation's
turns reach the replica that holds their cached prefix; other calls are balanced by --lb-policy.
`--no-envoy` runs without it: the bridge on --host:--port talks to the one engine directly.

Every process is a child, as it would be a container, supervised by `genserve.deploy.supervisor`: a child
that dies is restarted with back-off. While no engine serves, the bridge answers 503 with Retry-After and the engines cluster
takes a restarted replica back once its health check says SERVING.

SIGINT/SIGTERM stop them in order: the engines first, together, which drain (refuse new requests,
let open streams finish for up to `--drain-grace-s`) while the bridge and Envoy still answer (503
for new requests); then the bridge; then Envoy. The bridge never imports torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import sys
import tempfile
import time

from genserve.common.model_source import parse_model_source
from genserve.common.ports import PortInUse, check_ports_free, free_port
from genserve.deploy import envoy
from genserve.deploy.supervisor import (STOP_TIMEOUT_S, Child, supervise, wait_engine_ready,
                                        wait_http_ok)
from service.command_line import (HelpFormatter, add_engine_args, config_from_args, options_from_args,
                                  service_argv)

ENGINE_HOST = "127.0.0.1"     # engines, the bridge behind Envoy and Envoy's admin: localhost only
ENGINE_METRICS_PORT = 9400    # --metrics-port's default here (python -m service: none unless given)
ENVOY_CONCURRENCY = 1         # Envoy worker threads: loopback traffic needs one; the engines need the cores
CANCEL_RETRIES = 7            # the chart's envoy.cancel.numRetries, raised for many replicas
LB_POLICIES = ("LEAST_REQUEST", "ROUND_ROBIN", "RANDOM", "CLIENT_SIDE_WEIGHTED_ROUND_ROBIN")
EXIT_PORT_IN_USE = 3          # a port genserve serve would open is taken (as the engine's own exit code)


def dial_host(host: str) -> str:
    """The address to dial for a listener bound to `host`: loopback for a wildcard address,
    brackets around an IPv6 address."""
    if host in ("", "0.0.0.0"):
        return ENGINE_HOST
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def public_target(args: argparse.Namespace) -> str:
    """host:port where the bridge and the readiness check reach Envoy's public listener."""
    return f"{dial_host(args.host)}:{args.port}"


def engine_ports(args: argparse.Namespace) -> list[int]:
    """The engine replicas' gRPC ports: --grpc-port, --grpc-port + 1, ..."""
    return [args.grpc_port + i for i in range(args.replicas)]


def engine_metrics_ports(args: argparse.Namespace) -> list[int]:
    """The engine replicas' metrics ports: --metrics-port + i; none when metrics are off."""
    return [args.metrics_port + i for i in range(args.replicas)] if args.metrics_port else []


def engine_argv(args: argparse.Namespace, replica: int = 0) -> list[str]:
    """The command line of engine replica `replica` (0-based) for the parsed `genserve serve`
    flags: `python -m service` with the same engine flags (`service.command_line.service_argv`),
    serving gRPC on localhost at --grpc-port + replica, metrics at --metrics-port + replica.

    Raises:
        ValueError: the engine dials are not a valid EngineConfig (the message says which).
    """
    options = options_from_args(args)
    if options.metrics_port:
        options = dataclasses.replace(options, metrics_port=options.metrics_port + replica)
    argv = service_argv(config_from_args(args), options, host=ENGINE_HOST, port=args.grpc_port + replica)
    return [sys.executable, "-m", "service", *argv]


def bridge_argv(args: argparse.Namespace) -> list[str]:
    """The bridge child's command line for the parsed `genserve serve` flags (after
    `resolve_ports`): behind Envoy on 127.0.0.1:--bridge-port, calling the engines through
    Envoy's listener; with --no-envoy on --host:--port, calling the engine directly. It reads
    every replica's metrics, and names the model as the engines report it.

    Raises:
        ValueError: --model is not a valid spelling.
    """
    if args.no_envoy:
        target, host, port = f"{ENGINE_HOST}:{args.grpc_port}", args.host, args.port
    else:
        target, host, port = public_target(args), ENGINE_HOST, args.bridge_port
    argv = [sys.executable, "-m", "bridge", "--grpc-target", target,
            "--host", host, "--port", str(port), "--log-level", "warning",
            "--model-name", parse_model_source(args.model_path).served_name]
    for metrics_port in engine_metrics_ports(args):
        argv += ["--engine-metrics-url", f"http://{ENGINE_HOST}:{metrics_port}/metrics"]
    if args.max_body_bytes is not None:
        argv += ["--max-body-bytes", str(args.max_body_bytes)]
    argv += ["--keepalive-interval-s", repr(args.keepalive_interval_s)]
    return argv


def resolve_ports(args: argparse.Namespace) -> None:
    """Pick the ports left to the supervisor (0: a free port now): --bridge-port and
    --envoy-admin-port, each free now and none of the ports the flags name (the public port and
    the engines' not yet bound: the OS could hand one of them out as free) nor each other. A
    restarted child gets the same ports."""
    if args.no_envoy:
        return
    taken = {args.port, *engine_ports(args), *engine_metrics_ports(args),
             args.bridge_port, args.envoy_admin_port} - {0, None}

    def pick() -> int:
        while (port := free_port()) in taken:
            pass
        taken.add(port)
        return port

    args.bridge_port = args.bridge_port or pick()
    args.envoy_admin_port = args.envoy_admin_port or pick()


def listeners(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    """Every (what, host, port) `genserve serve` will listen on, for the parsed flags (after
    `resolve_ports`): the public listener, the engines' gRPC and metrics ports, and with Envoy the
    bridge behind it and Envoy's admin interface."""
    public = "bridge" if args.no_envoy else "Envoy listener"
    out = [(public, args.host, args.port)]
    out += [(f"engine {i} gRPC", ENGINE_HOST, port) for i, port in enumerate(engine_ports(args))]
    out += [(f"engine {i} metrics", ENGINE_HOST, port) for i, port in enumerate(engine_metrics_ports(args))]
    if not args.no_envoy:
        out += [("bridge", ENGINE_HOST, args.bridge_port), ("Envoy admin", ENGINE_HOST, args.envoy_admin_port)]
    return out


def envoy_config(args: argparse.Namespace) -> str:
    """Envoy's configuration for the parsed flags (after `resolve_ports`): the chart's template
    with the public listener on --host:--port, the bridge and the engine replicas as loopback
    upstreams, the admin interface on 127.0.0.1:--envoy-admin-port, no access log; checked with
    `envoy --mode validate`.

    Raises:
        ToolMissingError: Envoy or Helm is not installed.
        EnvoyConfigError: Helm or Envoy rejected the configuration (their output is the message).
    """
    text = envoy.render_envoy_config(
        listen_host=args.host, listen_port=args.port, admin_port=args.envoy_admin_port,
        bridge=[(ENGINE_HOST, args.bridge_port)], engines=[(ENGINE_HOST, p) for p in engine_ports(args)],
        extra_values={"envoy": {"accessLog": False,
                                # a refused call is retried on another replica; with one replica
                                # a retry would only ask the same engine again
                                "engines": {"lbPolicy": args.lb_policy,
                                            "affinity": {"enabled": args.prefix_affinity,
                                                         "hashBalanceFactor": args.hash_balance_factor},
                                            "numRetries": 1 if args.replicas > 1 else 0,
                                            # the engines accept pings this often (one flag)
                                            "keepaliveIntervalSeconds": args.keepalive_interval_s},
                                # enough tries to reach every replica despite the balancer
                                # re-picking tried ones
                                "cancel": {"numRetries": max(CANCEL_RETRIES, 2 * (args.replicas - 1))}}})
    envoy.validate_envoy_config(text)
    return text


def envoy_argv(config_path: pathlib.Path, base_id: int) -> list[str]:
    """Envoy's command line: `config_path`, no hot restart, warnings and errors only, and
    `base_id` (its shared-memory and domain-socket namespace) unique to this run so that two
    local runs never collide.

    Raises:
        ToolMissingError: Envoy is not installed.
    """
    return [str(envoy.tool_path("envoy")), "-c", str(config_path), "--disable-hot-restart",
            "--log-level", "warn", "--base-id", str(base_id), "--concurrency", str(ENVOY_CONCURRENCY)]


def wait_ready(args: argparse.Namespace, timeout_s: float) -> bool:
    """Whether the server answered within `timeout_s`: every engine replica SERVING on its own
    port, then, with Envoy, an engine SERVING through Envoy's listener (grpc.health.v1) and the
    bridge's /health 200 through it too.

    Every replica first, not any one: a replica still loading its model takes the cores, and the
    serving ones can then answer Envoy's health checks too late (1 s), be marked unhealthy, and
    leave Envoy routing to the loading one (panic routing); /health would then flap to 503 right
    after the ready message."""
    deadline = time.monotonic() + timeout_s
    for port in engine_ports(args):
        if not wait_engine_ready(f"{ENGINE_HOST}:{port}", max(deadline - time.monotonic(), 0.0)):
            return False
    if args.no_envoy:
        return True
    target = public_target(args)
    return wait_engine_ready(target, max(deadline - time.monotonic(), 0.0)) and \
        wait_http_ok(f"http://{target}/health", max(deadline - time.monotonic(), 0.0))


def ready_message(args: argparse.Namespace) -> str:
    """What `genserve serve` prints once it serves: the public addresses, then the internal ones."""
    public = f"{args.host}:{args.port}"
    lines = ["genserve ready",
             f"  REST+SSE  http://{public}/v1/completions",
             f"  gRPC      {public if not args.no_envoy else f'{ENGINE_HOST}:{args.grpc_port}'}"
             "  (genserve.v1.GenerateService)",
             f"  health    http://{public}/health",
             f"  metrics   http://{public}/metrics",
             f"  console   http://{public}/  (playground + live scheduler view)"]
    if not args.no_envoy:
        ports = engine_ports(args)
        engines = f"{ENGINE_HOST}:{ports[0]}" + (f"-{ports[-1]}" if len(ports) > 1 else "")
        lines += [f"  engines   {args.replicas} × gRPC {engines}, behind Envoy (admin "
                  f"http://{ENGINE_HOST}:{args.envoy_admin_port}, bridge {ENGINE_HOST}:{args.bridge_port})"]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The parser of the `genserve` command and its `serve` subcommand.

    `serve` takes the bridge's flags, the supervisor's, and the engine process's flags shared with
    `python -m service` (`service.command_line.add_engine_args`, which also adds one flag per
    EngineConfig dial).
    """
    parser = argparse.ArgumentParser(prog="genserve")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="start Envoy + bridge + engines on localhost", description=__doc__,
                       formatter_class=HelpFormatter)
    public = p.add_argument_group("public listener (Envoy; with --no-envoy, the bridge)")
    public.add_argument("--host", default="127.0.0.1", help="public address. Default: %(default)s.")
    public.add_argument("--port", type=int, default=8000,
                        help="public port: REST+SSE and, through Envoy, gRPC. Default: %(default)s.")
    public.add_argument("--no-envoy", action="store_true",
                        help="run without Envoy: the bridge on --host:--port calls the one engine directly "
                             "(the engine's gRPC on 127.0.0.1:--grpc-port).")
    public.add_argument("--lb-policy", choices=LB_POLICIES, default="LEAST_REQUEST",
                        help="how Envoy spreads the gRPC calls without a prefix routing key (and Cancel) "
                             "over the engine replicas; CLIENT_SIDE_WEIGHTED_ROUND_ROBIN weighs each "
                             "replica by the load reports in its answers (requests/s over utilization). "
                             "Default: %(default)s.")
    public.add_argument("--prefix-affinity", action=argparse.BooleanOptionalAction, default=True,
                        help="route requests that carry a prefix routing key (the bridge sets one on "
                             "each completion; gRPC callers send the x-genserve-prefix-key header) by "
                             "Envoy's consistent hashing with bounded load, so a conversation's turns "
                             "reach the replica holding their cached prefix; --no-prefix-affinity "
                             "balances every request by --lb-policy. Default: on.")
    public.add_argument("--hash-balance-factor", type=int, default=125,
                        help="bounded load of --prefix-affinity: a replica takes a key only while its "
                             "active requests are at most this percentage of the replicas' mean "
                             "(>= 100). Default: %(default)s.")
    public.add_argument("--envoy-admin-port", type=int, default=0,
                        help=f"Envoy's admin interface, on {ENGINE_HOST}. Default: a free port.")
    bridge = p.add_argument_group("bridge (REST+SSE)")
    bridge.add_argument("--bridge-port", type=int, default=0,
                        help=f"the bridge's port behind Envoy, on {ENGINE_HOST}. Default: a free port.")
    bridge.add_argument("--max-body-bytes", type=int, default=None,
                        help="largest request body the bridge reads, bytes (413 above). Default: 1 MiB.")
    supervisor = p.add_argument_group("supervisor")
    supervisor.add_argument("--ready-timeout-s", type=float, default=180.0,
                            help="seconds to wait for the engine's first SERVING before printing that it "
                                 "is not ready yet (supervision goes on). Default: %(default)s.")
    engine = add_engine_args(p, metrics_port=ENGINE_METRICS_PORT)
    engine.add_argument("--grpc-port", type=int, default=50051,
                        help=f"engine gRPC port, on {ENGINE_HOST}; replica i serves on --grpc-port + i "
                             "and its metrics on --metrics-port + i. Default: %(default)s.")
    engine.add_argument("--replicas", type=int, default=1,
                        help="engine processes, all behind Envoy (more than 1 needs Envoy); with "
                             "--threads 0 each takes the machine's cores / replicas threads. "
                             "Default: %(default)s.")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `genserve` command. Returns the exit code (2: invalid flags, or Envoy's
    configuration could not be made: a tool missing, or rejected; 3: a port it would open is
    already taken, named in the message; nothing was started)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.replicas < 1:
        parser.error("--replicas must be at least 1")
    if args.hash_balance_factor < 100:
        parser.error("--hash-balance-factor must be at least 100 (percent of the mean load)")
    if args.no_envoy and args.replicas > 1:
        parser.error(f"--replicas {args.replicas} needs Envoy to spread requests over the engines; "
                     "drop --no-envoy")
    resolve_ports(args)
    if args.replicas > 1 and args.threads == 0:
        # Replicas on one machine share its cores: each takes its share, not all of them
        # (threads spinning on a core another replica computes on slow both down).
        args.threads = max(1, len(os.sched_getaffinity(0)) // args.replicas)
    # The flags first (an invalid engine setting is a 2 whatever listens where), then the ports.
    try:
        drain_timeout_s = args.drain_grace_s + STOP_TIMEOUT_S
        children = [Child("engine" if args.replicas == 1 else f"engine-{i}", engine_argv(args, i),
                          stop_timeout_s=drain_timeout_s, stage=0) for i in range(args.replicas)]
        children.append(Child("bridge", bridge_argv(args), stage=1))
    except ValueError as exc:
        parser.exit(2, f"genserve {args.command}: error: {exc}\n")
    try:
        check_ports_free(listeners(args))
    except ValueError as exc:
        parser.error(str(exc))
    except PortInUse as exc:
        parser.exit(EXIT_PORT_IN_USE, f"genserve {args.command}: error: {exc}\n")
    if args.no_envoy:
        return supervise(children, lambda timeout_s: wait_ready(args, timeout_s), ready_message(args),
                         args.ready_timeout_s)
    with tempfile.TemporaryDirectory(prefix="genserve-envoy-") as tmp:
        config_path = pathlib.Path(tmp) / "envoy.yaml"
        try:
            config_path.write_text(envoy_config(args))
            argv = envoy_argv(config_path, base_id=os.getpid())
        except (envoy.ToolMissingError, envoy.EnvoyConfigError) as exc:
            parser.exit(2, f"genserve {args.command}: error: {exc}\n(or run without Envoy: --no-envoy)\n")
        children.append(Child("envoy", argv, stage=2))
        return supervise(children, lambda timeout_s: wait_ready(args, timeout_s), ready_message(args),
                         args.ready_timeout_s)


if __name__ == "__main__":
    sys.exit(main())

"""The engine process's command line, shared by `python -m service` and `genserve serve`: the
supervisor hands its flags to the engine child without losing or changing any."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from engine.config import EngineConfig
from engine.config_cli import engine_config_argv
from genserve.deploy import cli
from service.command_line import (DRAIN_GRACE_S, ProcessOptions, config_from_args, options_from_args,
                                  service_argv)
from service.server import build_parser
from tests.test_config_cli import NON_DEFAULT

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


def parse_service(argv: list[str]):
    """What `python -m service argv` would run: (config, options, host, port)."""
    args = build_parser().parse_args(argv)
    return config_from_args(args), options_from_args(args), args.host, args.port


def test_service_argv_round_trip():
    options = ProcessOptions(model_path="/models/x.gguf", metrics_port=9555, drain_grace_s=2.5,
                             tool_call_parser="mistral")
    argv = service_argv(NON_DEFAULT, options, host="0.0.0.0", port=6000)
    assert "--tool-call-parser=mistral" in argv
    assert parse_service(argv) == (NON_DEFAULT, options, "0.0.0.0", 6000)


def test_service_argv_of_defaults():
    argv = service_argv(EngineConfig(), ProcessOptions(), host="127.0.0.1", port=50051)
    assert parse_service(argv) == (EngineConfig(), ProcessOptions(), "127.0.0.1", 50051)
    assert parse_service([]) == (EngineConfig(), ProcessOptions(), "127.0.0.1", 50051)


def test_genserve_serve_hands_its_engine_flags_to_the_engine_child():
    args = cli.build_parser().parse_args(
        ["serve", "--grpc-port", "6001", "--port", "8001", "--model", "m.gguf", "--drain-grace-s", "4",
         *engine_config_argv(NON_DEFAULT)])
    argv = cli.engine_argv(args)
    assert argv[:3] == [sys.executable, "-m", "service"]
    assert parse_service(argv[3:]) == (
        NON_DEFAULT,
        ProcessOptions(model_path="m.gguf", metrics_port=cli.ENGINE_METRICS_PORT, drain_grace_s=4.0),
        cli.ENGINE_HOST, 6001)


def test_genserve_serve_defaults():
    args = cli.build_parser().parse_args(["serve"])
    assert parse_service(cli.engine_argv(args)[3:]) == (
        EngineConfig(), ProcessOptions(metrics_port=9400, drain_grace_s=DRAIN_GRACE_S), "127.0.0.1", 50051)
    cli.resolve_ports(args)
    # Behind Envoy: the bridge on an internal port, calling the engines through Envoy's listener.
    assert cli.bridge_argv(args)[3:] == [
        "--grpc-target", "127.0.0.1:8000", "--host", "127.0.0.1", "--port", str(args.bridge_port),
        "--log-level", "warning", "--model-name", "SmolLM2-135M-Instruct",
        "--engine-metrics-url", "http://127.0.0.1:9400/metrics", "--keepalive-interval-s", "30.0"]
    assert args.bridge_port not in (0, 8000) and args.envoy_admin_port not in (0, 8000, args.bridge_port)


def test_genserve_serve_without_envoy_is_the_direct_layout():
    args = cli.build_parser().parse_args(["serve", "--no-envoy"])
    cli.resolve_ports(args)
    assert cli.bridge_argv(args)[3:] == [
        "--grpc-target", "127.0.0.1:50051", "--host", "127.0.0.1", "--port", "8000", "--log-level", "warning",
        "--model-name", "SmolLM2-135M-Instruct", "--engine-metrics-url", "http://127.0.0.1:9400/metrics",
        "--keepalive-interval-s", "30.0"]


def test_genserve_serve_replicas_take_consecutive_ports():
    args = cli.build_parser().parse_args(["serve", "--replicas", "3", "--grpc-port", "7000",
                                          "--metrics-port", "7100", "--host", "0.0.0.0"])
    cli.resolve_ports(args)
    for i in range(3):
        _, options, host, port = parse_service(cli.engine_argv(args, i)[3:])
        assert (host, port, options.metrics_port) == ("127.0.0.1", 7000 + i, 7100 + i)
    bridge = cli.bridge_argv(args)
    assert bridge[bridge.index("--grpc-target") + 1] == "127.0.0.1:8000"     # Envoy, dialled on loopback
    assert [bridge[i + 1] for i, a in enumerate(bridge) if a == "--engine-metrics-url"] == [
        f"http://127.0.0.1:{7100 + i}/metrics" for i in range(3)]


def test_genserve_serve_refuses_replicas_without_envoy(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--no-envoy", "--replicas", "2"])
    assert exit_info.value.code == 2
    assert "--replicas 2 needs Envoy" in capsys.readouterr().err


def test_genserve_serve_refuses_invalid_dials_before_starting_anything(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--num-blocks", "1"])
    assert exit_info.value.code == 2
    assert "num_blocks must be >= 2" in capsys.readouterr().err


def test_both_commands_have_the_same_engine_flags():
    def engine_flags(parser) -> set[str]:
        return {opt for group in parser._action_groups if group.title.startswith("engine")
                for action in group._group_actions for opt in action.option_strings}

    serve_parser = cli.build_parser()._subparsers._group_actions[0].choices["serve"]
    assert engine_flags(serve_parser) - engine_flags(build_parser()) == {"--grpc-port", "--replicas"}
    assert engine_flags(build_parser()) <= engine_flags(serve_parser)


def test_the_supervisor_imports_no_torch():
    code = ("import sys, genserve.deploy.cli, service.command_line, engine.config_cli\n"
            "assert 'torch' not in sys.modules\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr


def test_the_supervisor_announces_readiness_that_comes_after_its_timeout(tmp_path):
    """A service still loading at --ready-timeout-s gets "not ready after ...; still trying", and
    the ready message when it does answer, so whoever waits for that line is not left waiting."""
    script = tmp_path / "late.py"
    script.write_text(
        "import sys, time\n"
        "from genserve.deploy.supervisor import Child, supervise\n"
        "t0 = time.monotonic()\n"
        "def ready(timeout_s):\n"
        "    time.sleep(min(timeout_s, 0.1))\n"
        "    return time.monotonic() - t0 > 1.0\n"
        "child = Child('sleeper', [sys.executable, '-c', 'import time; time.sleep(60)'], stop_timeout_s=5)\n"
        "sys.exit(supervise([child], ready, 'READY', ready_timeout_s=0.2))\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).resolve().parents[2])})
    try:
        lines = []
        while not lines or lines[-1].strip() != "READY":
            line = proc.stdout.readline()
            assert line, lines
            lines.append(line)
        assert any("not ready after 0.2 s; still trying" in line for line in lines), lines
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


def test_the_supervisors_ports_avoid_the_ports_the_flags_name(monkeypatch):
    """The bridge's and Envoy admin's ports are picked free now, but the engines' ports are not
    bound yet, so the OS may offer one of them (or the same port twice): those picks are skipped."""
    args = cli.build_parser().parse_args(["serve", "--grpc-port", "41000", "--metrics-port", "41100"])
    offers = iter([41000, 8000, 41100, 42000, 42000, 42001])
    monkeypatch.setattr(cli, "free_port", lambda: next(offers))
    cli.resolve_ports(args)
    assert (args.bridge_port, args.envoy_admin_port) == (42000, 42001)

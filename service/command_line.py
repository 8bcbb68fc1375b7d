"""The engine process's flags, declared once for `python -m service` and `genserve serve`.

Two kinds: the process's own settings (`ProcessOptions`: --model, --metrics-port,
--drain-grace-s) and one flag per EngineConfig dial, generated from the dataclass by
`engine.config_cli`. `genserve serve` adds these same flags to its parser and starts its engine
child with `service_argv`, the inverse of parsing them, so neither command restates the other's
flags. Imports no torch (the `genserve serve` supervisor loads none).
"""

from __future__ import annotations

import argparse
import textwrap
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.config_cli import add_engine_config_args, engine_config_argv, engine_config_from_args
from genserve.common.keepalive import PING_INTERVAL_S
from genserve.common.model_name import DEFAULT_MODEL_NAME
from genserve.common.model_source import RANDOM_SHAPES, parse_model_source
from genserve.common.tool_parsers import AUTO, TOOL_CALL_PARSERS

DRAIN_GRACE_S = 30.0          # SIGTERM: how long open streams may run on, seconds


@dataclass(frozen=True, slots=True)
class ProcessOptions:
    """Settings of one engine process that are not engine dials.

    Attributes:
        model_path: the model to serve, a `--model` value (`genserve.common.model_source`: a GGUF file,
            a Hugging Face safetensors directory, or random:SHAPE[:seed=N]; None: the embedded
            model, DEFAULT_MODEL_NAME).
        metrics_port: port of the engine's Prometheus /metrics (None: not served).
        drain_grace_s: on SIGTERM, seconds open streams may run on before they are ended.
        keepalive_interval_s: the HTTP/2 ping interval of the engine's callers (Envoy, the
            bridge), seconds; the gRPC server accepts pings that often
            (`genserve.common.keepalive.server_options`).
        tool_call_parser: the tool-call format (vLLM's `--tool-call-parser` names), or "auto":
            the family's, when the chat template defines tool calls
            (`genserve.common.tool_parsers.choose_tool_call_parser`).
        lora_modules: (name, directory) of each PEFT LoRA adapter loaded at start (vLLM's
            `--lora-modules name=path`); a bad one stops the start with its reason.
        enable_lora: serve LoRA adapters (implied by `lora_modules`): a request naming neither
            the base model nor a loaded adapter is then a 404 model_not_found; adapters may be
            loaded at run time (POST /v1/load_lora_adapter) either way.
    """

    model_path: str | None = None
    metrics_port: int | None = None
    drain_grace_s: float = DRAIN_GRACE_S
    keepalive_interval_s: float = PING_INTERVAL_S
    tool_call_parser: str = AUTO
    lora_modules: tuple[tuple[str, str], ...] = ()
    enable_lora: bool = False


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """argparse's help layout, with the description printed as written and help texts never
    wrapped at a hyphen (a flag named in a help text stays whole: not "--kv-" / "pool-gib")."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def add_engine_args(parser: argparse.ArgumentParser, *,
                    metrics_port: int | None = None) -> argparse._ArgumentGroup:
    """Add the engine process's flags to `parser`: ProcessOptions', then one per EngineConfig dial.

    Args:
        parser: the command's parser.
        metrics_port: --metrics-port's default (None: metrics off unless the flag is given).

    Returns:
        The "engine process" argument group, where a command adds its own engine-process flags
        (`genserve serve --grpc-port`).
    """
    group = parser.add_argument_group("engine process")
    group.add_argument("--model", dest="model_path", default=None, metavar="PATH",
                       help="the model to serve: a GGUF file, a Hugging Face Llama checkpoint "
                            "directory (config.json, *.safetensors, tokenizer.json), or "
                            f"random:SHAPE[:seed=N] (random weights; SHAPE one of {', '.join(RANDOM_SHAPES)}). "
                            f"Nothing is downloaded. Default: the embedded {DEFAULT_MODEL_NAME}.")
    group.add_argument("--metrics-port", type=int, default=metrics_port, metavar="PORT",
                       help="serve the engine's Prometheus metrics on this port. Default: "
                            + ("off." if metrics_port is None else "%(default)s."))
    group.add_argument("--drain-grace-s", type=float, default=DRAIN_GRACE_S, metavar="SECONDS",
                       help="on SIGTERM, how long open streams may run on before they are ended. "
                            "Default: %(default)s.")
    group.add_argument("--keepalive-interval-s", type=float, default=PING_INTERVAL_S, metavar="SECONDS",
                       help="how often the engine's callers (Envoy, the bridge) ping an idle "
                            "connection; the gRPC server accepts pings that often. Default: %(default)s.")
    group.add_argument("--tool-call-parser", default=AUTO, choices=(AUTO,) + TOOL_CALL_PARSERS,
                       help="the tool-call format the model's chat template teaches, by vLLM's names "
                            "(hermes: Qwen's <tool_call>; llama3_json: Llama 3.1's JSON; mistral: "
                            "[TOOL_CALLS]). auto: the family's, when the template reads `tools`; a "
                            "template without tool syntax gets the generic tool prompt. "
                            "Default: %(default)s.")
    group.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                       help="LoRA adapters to serve, each a PEFT adapter directory under the name "
                            "requests give as `model` (vLLM's flag); implies --enable-lora.")
    group.add_argument("--enable-lora", action="store_true",
                       help="serve LoRA adapters: a `model` that is neither the served model nor a "
                            "loaded adapter is a 404 (off: any name is the base model).")
    add_engine_config_args(parser)
    return group


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig given by the flags of `add_engine_args`.

    Raises:
        ValueError: the values are not a valid EngineConfig (the message says which).
    """
    return engine_config_from_args(args)


def options_from_args(args: argparse.Namespace) -> ProcessOptions:
    """The ProcessOptions given by the flags of `add_engine_args`.

    Raises:
        ValueError: --model is not a valid spelling (`genserve.common.model_source.parse_model_source`).
    """
    parse_model_source(args.model_path)
    if not args.keepalive_interval_s > 0:
        raise ValueError(f"--keepalive-interval-s must be > 0, got {args.keepalive_interval_s}")
    modules = []
    for item in getattr(args, "lora_modules", None) or []:
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"--lora-modules: {item!r} is not NAME=PATH")
        if name.strip() in dict(modules):
            raise ValueError(f"--lora-modules: the name {name.strip()!r} is given twice")
        modules.append((name.strip(), path.strip()))
    return ProcessOptions(model_path=args.model_path, metrics_port=args.metrics_port,
                          drain_grace_s=args.drain_grace_s, keepalive_interval_s=args.keepalive_interval_s,
                          tool_call_parser=args.tool_call_parser, lora_modules=tuple(modules),
                          enable_lora=bool(getattr(args, "enable_lora", False) or modules))


def service_argv(config: EngineConfig, options: ProcessOptions, *, host: str, port: int) -> list[str]:
    """Arguments of `python -m service` (what follows it) for an engine with `config` and
    `options`, serving gRPC on `host`:`port`. Parsing them gives `config` and `options` back.

    Raises:
        ValueError: `config` holds a value the command line cannot spell (see
            `engine.config_cli.engine_config_argv`).
    """
    argv = [f"--host={host}", f"--port={port}", f"--drain-grace-s={options.drain_grace_s!r}",
            f"--keepalive-interval-s={options.keepalive_interval_s!r}"]
    if options.model_path is not None:
        argv.append(f"--model={options.model_path}")
    if options.metrics_port is not None:
        argv.append(f"--metrics-port={options.metrics_port}")
    if options.tool_call_parser != AUTO:
        argv.append(f"--tool-call-parser={options.tool_call_parser}")
    if options.lora_modules:
        argv += ["--lora-modules", *(f"{name}={path}" for name, path in options.lora_modules)]
    if options.enable_lora:
        argv.append("--enable-lora")
    return argv + engine_config_argv(config)

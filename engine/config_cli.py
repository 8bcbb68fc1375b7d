"""EngineConfig on the command line: one flag per field, generated from the dataclass, and back.

Every field of `engine.config.EngineConfig` becomes a `--kebab-case` flag whose type and default
are the field's and whose help is the field's entry in the class docstring's "Attributes:"
section, so a new dial is on the command line of `python -m service` and `genserve serve` as soon
as it is declared and documented. The docstring stays the one place the dials are described: it
reads as one table, which per-field `metadata={"help": ...}` would scatter over thirty
`field(...)` calls. `FLAG_SPELLINGS` lists the fields spelled otherwise on the command line
(and a renamed field's old flag, kept as an alias for a release), `FLAG_CHOICES` the ones with a
closed set of values.

`engine_config_argv` writes a config back as flags (the round trip
`engine_config_from_args(parse(engine_config_argv(c))) == c` holds), which is how
`genserve serve` hands its settings to the engine process. Imports no torch.
"""

from __future__ import annotations

import argparse
import inspect
import re
import types
import typing
from dataclasses import MISSING, dataclass, fields
from typing import Any

from engine.config import (BATCHING_MODES, DEVICES, DTYPES, KV_CACHE_DTYPES, LORA_DTYPES, PREFIX_CACHE_SCOPES,
                           WEIGHTS, EngineConfig)

GIB = 1024**3
GB = 10**9


@dataclass(frozen=True, slots=True)
class FlagSpelling:
    """How a field is spelled on the command line when not as `--` + its name in kebab case.

    Attributes:
        flag: the flag, e.g. "--threads".
        scale: field value = command-line value × scale (the command line's unit in the field's
            unit; 1 = the same unit). A scaled flag takes a float; an int field keeps the integer
            part of the product.
        help: replaces the field's docstring text (say the command line's unit); None keeps it.
        aliases: older spellings of the flag that still work (a renamed field's old flag).
    """

    flag: str
    scale: int = 1
    help: str | None = None
    aliases: tuple[str, ...] = ()


FLAG_SPELLINGS: typing.Mapping[str, FlagSpelling] = types.MappingProxyType({
    "num_threads": FlagSpelling("--threads"),
    "kv_pool_bytes": FlagSpelling(
        "--kv-pool-gib", scale=GIB,
        help="memory budget of the paged K/V tensors on CPU, GiB (ignored when --num-blocks is "
             "given; on CUDA the pool takes the free memory, see --activation-reserve-gb)"),
    "activation_reserve_bytes": FlagSpelling(
        "--activation-reserve-gb", scale=GB,
        help="on CUDA, device memory kept free for the forward pass's activations, GB (10^9 "
             "bytes); the KV pool takes the free memory left after the weights and this reserve "
             "unless --num-blocks is given"),
    # Renamed to the field's term (vLLM's max_num_batched_tokens); the old flags stay a release.
    "prefill_token_budget": FlagSpelling("--prefill-token-budget", aliases=("--prefill-chunk",)),
    "prefill_token_budget_few_rows": FlagSpelling("--prefill-token-budget-few-rows",
                                                  aliases=("--prefill-chunk-few-rows",)),
})
FLAG_CHOICES: typing.Mapping[str, tuple[str, ...]] = types.MappingProxyType({
    "dtype": DTYPES,
    "batching": BATCHING_MODES,
    "device": DEVICES,
    "kv_cache_dtype": KV_CACHE_DTYPES,
    "lora_dtype": LORA_DTYPES,
    "prefix_cache_scope": PREFIX_CACHE_SCOPES,
    "weights": WEIGHTS,
})


@dataclass(frozen=True, slots=True)
class FieldFlag:
    """One EngineConfig field as a command-line flag.

    Attributes:
        field: the EngineConfig attribute.
        flag: the flag, e.g. "--max-rows".
        aliases: older spellings that set the same field.
        dest: where argparse stores the value in its Namespace ("max_rows", "threads").
        field_type: the field's type without None: int, float, str or bool (a bool is a pair of
            flags, `--name` and `--no-name`).
        arg_type: what the flag's value parses as (float for a scaled flag, else field_type).
        default: the command-line default (the field's default / scale).
        scale: field value = command-line value × scale.
        choices: the values allowed, or None for any.
        help: the help text, argparse-escaped, ending with the default (none for None).
    """

    field: str
    flag: str
    aliases: tuple[str, ...]
    dest: str
    field_type: type
    arg_type: type
    default: Any
    scale: int
    choices: tuple[str, ...] | None
    help: str

    def to_field(self, value: Any) -> Any:
        """The field's value for the command-line `value` (None stays None)."""
        if value is None or self.scale == 1:
            return value
        return self.field_type(value * self.scale)

    def to_text(self, value: Any) -> str:
        """The command-line text of the field's `value`; parses back to `value` exactly.

        Floats are written with `repr`, the shortest text that reads back as the same float
        (a scaled int below 2**53 divided by a power of two is exact, so it returns exactly).

        Raises:
            ValueError: `value` is None (an optional field has no spelling for None).
        """
        if value is None:
            raise ValueError(f"{self.field}=None cannot be given on the command line")
        if self.scale != 1:
            value = value / self.scale
        return repr(value) if isinstance(value, float) else str(value)


def attribute_docs(cls: type) -> dict[str, str]:
    """Each attribute's text in the "Attributes:" section of `cls`'s docstring (Google style).

    An entry is a line `name: text` one indent below "Attributes:", continued by the more deeply
    indented lines after it; `a / b: text` documents a and b with one text. The section ends at
    the first line indented no deeper than "Attributes:". Texts come back on one line.

    Raises:
        ValueError: there is no "Attributes:" section, or an entry does not start `name:`.
    """
    lines = inspect.cleandoc(cls.__doc__ or "").splitlines()
    if "Attributes:" not in lines:
        raise ValueError(f"{cls.__name__}'s docstring has no 'Attributes:' section")
    docs: dict[str, list[str]] = {}
    names: list[str] = []
    entry_indent = None
    for line in lines[lines.index("Attributes:") + 1:]:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent == 0 or (entry_indent is not None and indent < entry_indent):
            break
        if entry_indent is None:
            entry_indent = indent
        if indent == entry_indent:
            head, colon, text = line.strip().partition(":")
            names = [name.strip() for name in head.split("/")]
            if not colon or not all(name.isidentifier() for name in names):
                raise ValueError(f"{cls.__name__}: attribute entry does not start 'name:': {line.strip()!r}")
            for name in names:
                docs[name] = [text]
        else:
            for name in names:
                docs[name].append(line)
    return {name: " ".join(" ".join(parts).split()) for name, parts in docs.items()}


def engine_flags() -> tuple[FieldFlag, ...]:
    """The command-line flag of every EngineConfig field, in field order.

    Raises:
        TypeError: a field has a type other than int, float, str, bool or one of them | None, or no
            default (it could not be left off the command line).
        ValueError: a field has no text in the class docstring's "Attributes:" section.
    """
    docs = attribute_docs(EngineConfig)
    hints = typing.get_type_hints(EngineConfig)
    flag_of = {f.name: _spelling(f.name).flag for f in fields(EngineConfig)}
    result = []
    for f in fields(EngineConfig):
        field_type = _plain_type(f.name, hints[f.name])
        if f.default is MISSING:
            raise TypeError(f"EngineConfig.{f.name} has no default; every dial needs one to be optional")
        spelling = _spelling(f.name)
        text = spelling.help or docs.get(f.name)
        if not text:
            raise ValueError(f"EngineConfig.{f.name} is not documented in the class docstring's Attributes")
        default = f.default if f.default is None or spelling.scale == 1 else f.default / spelling.scale
        result.append(FieldFlag(
            field=f.name, flag=spelling.flag, aliases=spelling.aliases,
            dest=spelling.flag[2:].replace("-", "_"),
            field_type=field_type, arg_type=float if spelling.scale != 1 else field_type,
            default=default, scale=spelling.scale, choices=FLAG_CHOICES.get(f.name),
            help=_help_text(text, default, flag_of)))
    return tuple(result)


def add_engine_config_args(parser: argparse.ArgumentParser) -> None:
    """Add one flag per EngineConfig field to `parser`, in a group of their own."""
    group = parser.add_argument_group(
        "engine dials (EngineConfig)",
        "Scheduler and KV-pool settings; the defaults are the design's numbers.")
    for flag in engine_flags():
        if flag.field_type is bool:
            group.add_argument(flag.flag, *flag.aliases, dest=flag.dest, default=flag.default,
                               help=flag.help, action=argparse.BooleanOptionalAction)
            continue
        group.add_argument(flag.flag, *flag.aliases, dest=flag.dest, type=flag.arg_type,
                           default=flag.default, choices=flag.choices, help=flag.help)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig that the flags of `add_engine_config_args` parsed into `args` describe.

    Raises:
        ValueError: the values are not a valid EngineConfig (`EngineConfig.__post_init__` says
            which).
    """
    return EngineConfig(**{flag.field: flag.to_field(getattr(args, flag.dest)) for flag in engine_flags()})


def engine_config_argv(config: EngineConfig) -> list[str]:
    """The flags that give `config`: one `--flag=value` per field that differs from its default
    (`--flag` / `--no-flag` for a bool).

    Raises:
        ValueError: an optional field whose default is not None is None (no spelling for it).
    """
    defaults = EngineConfig()
    argv = []
    for flag in engine_flags():
        value = getattr(config, flag.field)
        if value == getattr(defaults, flag.field):
            continue
        if flag.field_type is bool:
            argv.append(flag.flag if value else "--no-" + flag.flag[2:])
        else:
            argv.append(f"{flag.flag}={flag.to_text(value)}")
    return argv


def _spelling(name: str) -> FlagSpelling:
    return FLAG_SPELLINGS.get(name) or FlagSpelling("--" + name.replace("_", "-"))


def _plain_type(name: str, hint: Any) -> type:
    """int, float or str out of a field's type hint, `X | None` unwrapped."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        hint = members[0] if len(members) == 1 else hint
    if hint not in (int, float, str, bool):
        raise TypeError(f"EngineConfig.{name}: type {hint!r} has no command-line spelling "
                        "(int, float, str, bool, or one of them | None)")
    return hint


def _help_text(text: str, default: Any, flag_of: dict[str, str]) -> str:
    """`text` for argparse: `field` references become their flags, % is escaped, default added."""
    text = re.sub(r"`([^`]+)`", lambda m: flag_of.get(m.group(1), m.group(1)), text)
    text = text.replace("%", "%%")
    return text if default is None else f"{text.rstrip('.')}. Default: %(default)s."

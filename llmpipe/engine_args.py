"""The engine's command-line flags, generated from EngineConfig's fields (vLLM's EngineArgs): one
definition of every option, its default, choices and help, for every command that loads a model
(`generate`, `chat`, `serve`, `eval`, `diagnose`, `bench`) and for the Ray deployment's args; and
`generate` / `chat`'s sampling flags, typed from SamplingParams' fields."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, Callable

from llmpipe.config import EngineConfig
from llmpipe.sampling_params import SamplingParams

NONE_WORD = "none"  # how a flag spells None (e.g. --quantization none)


def cli_fields() -> list[dataclasses.Field]:
    """The EngineConfig fields that are flags, `model` first."""
    return [f for f in dataclasses.fields(EngineConfig) if f.metadata.get("cli", True)]


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    for f in cli_fields():
        parser.add_argument(flag_name(f.name), **argparse_options(f))


def add_engine_arg(parser: argparse.ArgumentParser, name: str) -> None:
    """One engine flag alone (a command that sets only it)."""
    parser.add_argument(flag_name(name), **argparse_options(next(f for f in cli_fields() if f.name == name)))


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig's options from parsed flags (all but --model, which callers pass as the model)."""
    return {f.name: getattr(args, f.name) for f in cli_fields() if f.name != "model" and hasattr(args, f.name)}


def argparse_options(f: dataclasses.Field) -> dict[str, Any]:
    """add_argument's keywords for a field: its default and help, and a type (or a switch) from its annotation."""
    kind, optional = _base_type(typing.get_type_hints(EngineConfig)[f.name])
    options: dict[str, Any] = {"default": f.default, "help": f.metadata["help"]}
    if kind is bool:
        return options | {"action": argparse.BooleanOptionalAction if f.default else "store_true"}
    if typing.get_origin(kind) is list:  # --lora-modules a=x b=y: one flag, several items
        return options | {"nargs": "+", "type": typing.get_args(kind)[0], "metavar": "ITEM"}
    options["type"] = _parser(kind, optional)
    if f.metadata.get("choices") is not None:
        options["choices"] = list(f.metadata["choices"])
    return options


def _base_type(annotation: Any) -> tuple[type, bool]:
    """(the type a flag's text converts to, whether None is allowed). A union of several types (bytes or a
    size string) is taken as text, for EngineConfig to parse."""
    args = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    kinds = [a for a in args if a is not type(None)]
    return (kinds[0] if len(kinds) == 1 else str), type(None) in args


def _parser(kind: type, optional: bool) -> Callable[[str], Any]:
    if not optional:
        return kind

    def parse(text: str) -> Any:
        return None if text == NONE_WORD else kind(text)

    parse.__name__ = kind.__name__  # argparse names it in "invalid int value: 'x'"
    return parse


def options_table() -> list[str]:
    """docs/getting-started.md's table of engine options: one Markdown row per EngineConfig option."""
    rows = []
    for f in dataclasses.fields(EngineConfig):
        if "help" not in f.metadata:
            continue
        flag = f"`{flag_name(f.name)}`" if f.metadata["cli"] else "(Python only)"
        default = NONE_WORD if f.default is None else f.default
        rows.append(f"| `{f.name}` | {flag} | `{default}` | {f.metadata['help']} |")
    return rows


# The sampling flags of `generate` and `chat`, and where their defaults differ from SamplingParams' (greedy,
# a longer reply).
SAMPLING_FLAGS = {"max_tokens": 256, "temperature": 0.0, "top_p": None, "top_k": None, "min_p": None,
                  "repetition_penalty": None, "seed": None, "stop": None}


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    fields = {f.name: f for f in dataclasses.fields(SamplingParams)}
    hints = typing.get_type_hints(SamplingParams)
    for name, default in SAMPLING_FLAGS.items():
        default = fields[name].default if default is None else default
        if name == "stop":
            parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
            continue
        kind, optional = _base_type(hints[name])
        parser.add_argument(flag_name(name), type=_parser(kind, optional), default=default)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(**{name: getattr(args, name) for name in SAMPLING_FLAGS})

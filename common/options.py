"""Command-line options defined once, as dataclass fields: each field's flag, type, default and
help generate its ``argparse`` argument; a parsed namespace builds the dataclass; and an
instance serialises itself back to argv (how ``headrace serve`` starts its data plane
children), so no option is ever copied by hand between a parser, an argv and a constructor.

A field's flag is ``--`` plus its name with dashes; a bool field gets ``--name/--no-name``;
``Optional[X]`` fields default to None and are left out of argv while None."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import types
import typing

_BOOL = argparse.BooleanOptionalAction


def option(default=dataclasses.MISSING, help: str = "", *, aliases: tuple[str, ...] = (),
           short: str | None = None, choices: tuple | None = None):
    """A dataclass field that is also a command-line option. ``aliases``: deprecated flags
    parsed into the same field and hidden from ``--help``; ``short``: e.g. ``-tp``;
    ``choices``: the values the command line accepts."""
    return dataclasses.field(default=default, metadata={"help": help, "aliases": aliases,
                                                        "short": short, "choices": choices})


def flag(field: dataclasses.Field) -> str:
    return "--" + field.name.replace("_", "-")


@functools.cache
def _types(cls) -> dict[str, type]:
    """Each field's scalar type (``int | None`` -> int)."""
    out = {}
    for name, hint in typing.get_type_hints(cls).items():
        if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
            (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
        out[name] = hint
    return out


def _fields(cls, only=None, skip=()):
    return [f for f in dataclasses.fields(cls)
            if f.name not in skip and (only is None or f.name in only)]


def add_arguments(parser: argparse.ArgumentParser, cls, *, only=None, skip=()) -> None:
    """Adds ``cls``'s fields (``only`` those / all but ``skip``) as options of ``parser``."""
    kinds = _types(cls)
    for f in _fields(cls, only, skip):
        meta, kind = f.metadata, kinds[f.name]
        default = None if f.default is dataclasses.MISSING else f.default
        names = [flag(f)] + ([meta["short"]] if meta.get("short") else [])
        kwargs = dict(dest=f.name, default=default, help=meta.get("help", ""))
        if meta.get("choices"):
            kwargs["choices"] = meta["choices"]
        if kind is bool:
            parser.add_argument(*names, action=_BOOL, **kwargs)
        else:
            parser.add_argument(*names, type=kind, **kwargs)
        for alias in meta.get("aliases", ()):
            parser.add_argument(alias, dest=f.name, default=argparse.SUPPRESS,
                                help=argparse.SUPPRESS, **({"action": _BOOL} if kind is bool
                                                          else {"type": kind}))


def from_args(cls, args: argparse.Namespace, **overrides):
    """``cls`` built from the parsed options (every field must have been added)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
    return cls(**(values | overrides))


def to_argv(obj) -> list[str]:
    """The options that parse back into ``obj`` (``from_args(type(obj), parse(to_argv(obj)))
    == obj``)."""
    argv: list[str] = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if value is None:
            continue
        if isinstance(value, bool):
            argv.append(flag(f) if value else "--no-" + flag(f)[2:])
        else:
            argv += [flag(f), str(value)]
    return argv

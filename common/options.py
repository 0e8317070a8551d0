"""Command-line options defined once, as dataclass fields: each field's flag, type, default and
help generate its ``argparse`` argument; a parsed namespace builds the dataclass; and an
instance serialises itself back to argv (how ``headrace serve`` starts its data plane
children), so no option is ever copied by hand between a parser, an argv and a constructor.

A field's flag is ``--`` plus its name with dashes; a bool field gets ``--name/--no-name``;
``Optional[X]`` fields default to None and are left out of argv while None. Each field names
the ``--help`` heading (argparse group) it is listed under; ``argument_group`` finds or makes a
parser's group by that title, so options defined in several places share their headings."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import types
import typing

_BOOL = argparse.BooleanOptionalAction

# The ``--help`` headings of the command line's options (argparse groups, in this order).
MODEL = "model"
DEVICE = "device, memory and kernels (the data plane)"
PARALLEL = "parallelism (several GPUs or processes)"
SCHEDULING = "scheduling and limits"
SERVER = "network and API servers"
SECURITY = "security: TLS, tokens and secrets"
OBSERVABILITY = "logs and metrics"
GROUPS = (MODEL, DEVICE, PARALLEL, SCHEDULING, SERVER, SECURITY, OBSERVABILITY)


def argument_group(parser: argparse.ArgumentParser, title: str | None):
    """``parser``'s argument group titled ``title`` (made on first use; None: the parser)."""
    if title is None:
        return parser
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title)


def add_groups(parser: argparse.ArgumentParser, titles=GROUPS) -> None:
    """Makes ``titles``' groups now, so ``--help`` lists them in this order."""
    for title in titles:
        argument_group(parser, title)


def option(default=dataclasses.MISSING, help: str = "", *, aliases: tuple[str, ...] = (),
           short: str | None = None, choices: tuple | None = None,
           synonyms: tuple[str, ...] = (), group: str | None = None):
    """A dataclass field that is also a command-line option. ``aliases``: deprecated flags
    parsed into the same field and hidden from ``--help``; ``synonyms``: other names shown
    beside the flag (another project's name for the same option); ``short``: e.g. ``-tp``;
    ``choices``: the values the command line accepts; ``group``: its ``--help`` heading."""
    return dataclasses.field(default=default, metadata={"help": help, "aliases": aliases,
                                                        "short": short, "choices": choices,
                                                        "synonyms": synonyms, "group": group})


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
        target = argument_group(parser, meta.get("group"))
        default = None if f.default is dataclasses.MISSING else f.default
        names = [flag(f), *meta.get("synonyms", ())] + ([meta["short"]] if meta.get("short") else [])
        kwargs = dict(dest=f.name, default=default, help=meta.get("help", ""))
        if meta.get("choices"):
            kwargs["choices"] = meta["choices"]
        if kind is bool:
            target.add_argument(*names, action=_BOOL, **kwargs)
        else:
            target.add_argument(*names, type=kind, **kwargs)
        for alias in meta.get("aliases", ()):
            target.add_argument(alias, dest=f.name, default=argparse.SUPPRESS,
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

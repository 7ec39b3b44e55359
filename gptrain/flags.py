"""How a ``gptrain train`` flag is declared, and what is generated from the declarations.

Each flag is declared once: on the config field it sets (gptrain/config.py), as
``field(default=..., metadata=flag("--name", group=..., help=...))`` (its default and type are the
field's); flags that set no single field (Megatron's recompute flags, ``--fp8``, ``--deepspeed``, ...)
in ``flag_tables.DERIVED_FLAGS``; Megatron flags accepted without effect or refused in
``flag_tables.COMPATIBILITY``, each with its reason. From these ``build_parser`` makes the argument parser
(groups in Megatron's order, hidden entries for the accepted no-op flags), and with it the
``--help`` text and its closing table of accepted and refused flags.
"""
from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Callable, Iterable

# the titles of Megatron's arguments.py groups, in its order, then gptrain's own
GROUPS = ("network size", "regularization", "training", "initialization", "learning rate", "checkpointing",
          "mixed precision", "distributed", "validation", "data and dataloader", "logging",
          "kernels and speed (gptrain)", "run (gptrain)")

METADATA_KEY = "flag"
FIELD_DEFAULT = object()  # Flag.default: the config field's own default


@dataclass(frozen=True)
class Flag:
    """One command-line flag: its names (Megatron's first, then aliases), group and one-line help;
    ``type``/``action``/``nargs``/``choices`` as argparse takes them. On a field, ``dest`` and
    ``default`` come from the field (``default`` given here only where the parser must tell "not
    given" apart, e.g. None for a value filled in from a ds.json)."""
    names: tuple[str, ...]
    group: str
    help: str
    type: Callable | None = None
    action: str | None = None  # store_true, store_false or store_const
    const: Any = None
    nargs: str | None = None
    choices: tuple | None = None
    metavar: str | tuple[str, ...] | None = None  # the value's name(s) in --help (default: N, X, PATH or VALUE)
    default: Any = FIELD_DEFAULT
    dest: str | None = None

    def __post_init__(self):
        if not self.names or not all(n.startswith("--") for n in self.names):
            raise ValueError(f"flag names {self.names}: each starts with --")
        if self.group not in GROUPS:
            raise ValueError(f"{self.names[0]}: group {self.group!r} is not one of {GROUPS}")
        if not self.help or "\n" in self.help or len(self.help) > 400:
            raise ValueError(f"{self.names[0]}: give one line of help")

    @property
    def name(self) -> str:
        return self.names[0]

    def argparse_kwargs(self) -> dict:
        kwargs = {"dest": self.dest, "help": self.help}
        if self.action is not None:
            kwargs["action"] = self.action
            if self.action == "store_const":
                kwargs["const"] = self.const
        else:
            for key in ("type", "nargs", "choices", "metavar"):
                if getattr(self, key) is not None:
                    kwargs[key] = list(self.choices) if key == "choices" else getattr(self, key)
        if self.default is not FIELD_DEFAULT and self.action not in ("store_true", "store_false"):
            kwargs["default"] = self.default
        return kwargs


def flag(*names: str, group: str, help: str, **kwargs) -> dict:
    """The metadata of a config field that a flag sets: ``field(default=..., metadata=flag(...))``."""
    return {METADATA_KEY: Flag(names, group, help, **kwargs)}


def field_flag(field: dataclasses.Field, hint: Any, declared: Flag | None = None) -> Flag | None:
    """The flag of a config field (declared on it, or ``declared`` for a field of another module's
    dataclass), completed from the field: its name as ``dest``, its default, its type
    (bool: a switch, list: one or more values)."""
    declared = declared or field.metadata.get(METADATA_KEY)
    if declared is None:
        return None
    extra: dict[str, Any] = {"dest": field.name}
    if declared.default is FIELD_DEFAULT:
        extra["default"] = (field.default_factory() if field.default_factory is not dataclasses.MISSING
                            else field.default)
    kinds = [t for t in (typing.get_args(hint) or (hint,)) if t is not type(None)]
    if declared.action is None and declared.type is None and declared.nargs is None:
        if hint is bool:
            extra["action"] = "store_true"
        elif typing.get_origin(hint) is list:
            extra["nargs"] = "+"
        elif len(kinds) == 1 and kinds[0] in (int, float):
            extra["type"] = kinds[0]
    return dataclasses.replace(declared, **extra)


@dataclass(frozen=True)
class Compat:
    """A Megatron flag gptrain accepts without effect or refuses, with the reason printed.
    kind: "switch" (accepted, no value), "value" (accepted with a value; ``values``: the ones
    allowed, None: any) or "refused" (an error naming the reason)."""
    name: str
    reason: str
    kind: str = "switch"
    values: tuple[str, ...] | None = None

    def __post_init__(self):
        if self.kind not in ("switch", "value", "refused") or not self.reason or "\n" in self.reason:
            raise ValueError(f"{self.name}: kind switch, value or refused, and a one-line reason")

    @property
    def dest(self) -> str:
        return "compat:" + self.name


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """One line per flag where it fits; a default shown when it says something."""

    def __init__(self, prog):
        super().__init__(prog, max_help_position=36)

    def _get_default_metavar_for_optional(self, action):
        if action.type is int or action.type is float:
            return "N" if action.type is int else "X"
        return "PATH" if any(w in action.dest for w in ("path", "dir", "file", "save", "load", "config")) else "VALUE"

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if default not in (None, False, [], argparse.SUPPRESS) and not isinstance(action, argparse._StoreConstAction) \
                and "default" not in text:
            text += f" (default: {default})"
        return text


def compatibility_table(compat: Iterable[Compat]) -> str:
    """The end of ``--help``: the accepted no-op flags and the refused ones, with their reasons."""
    compat = list(compat)
    lines = ["accepted Megatron flags that change nothing here:"]
    lines += [f"  {c.name}: {c.reason}" for c in compat if c.kind == "switch"]
    for c in compat:
        if c.kind == "value":
            values = f" ({' or '.join(c.values)} only)" if c.values else ""
            lines.append(f"  {c.name} VALUE{values}: {c.reason}")
    lines += ["", "refused Megatron flags (an error, never ignored):"]
    lines += [f"  {c.name}: {c.reason}" for c in compat if c.kind == "refused"]
    lines += ["", "any other unknown flag is refused too."]
    return "\n".join(lines)


class OneLineErrors(argparse.ArgumentParser):
    """A parser whose errors (a bad value, a missing one) raise ValueError, which the command prints as
    one line and exits 2, instead of argparse's usage block."""

    def error(self, message):
        raise ValueError(f"{message} (see `{self.prog} --help`)")


def suggest(given: str, known: Iterable[str]) -> str | None:
    """The declared flag a mistyped one is (at most two characters inserted, dropped or changed), or None:
    a Megatron flag gptrain lacks (--vocab-file for --vocab-size) gets no suggestion."""
    import difflib

    for close in difflib.get_close_matches(given, list(known), n=3, cutoff=0.75):
        edits = sum(max(i2 - i1, j2 - j1) for op, i1, i2, j1, j2 in
                    difflib.SequenceMatcher(None, given, close).get_opcodes() if op != "equal")
        if edits <= 2:
            return close
    return None


def build_parser(flags: Iterable[Flag], compat: Iterable[Compat], prog: str = "gptrain train",
                 description: str = "GPT pretraining with pretrain_gpt.py flags") -> argparse.ArgumentParser:
    """The parser of ``flags`` (each in its group, groups in ``GROUPS`` order, flags in declaration
    order) and of the accepted no-op flags of ``compat`` (hidden; listed by the epilog). Refused
    flags are left out: ``parse_megatron_args`` refuses them by name before parsing."""
    flags, compat = list(flags), list(compat)
    parser = OneLineErrors(prog=prog, description=description, allow_abbrev=False,
                           formatter_class=_Formatter, epilog=compatibility_table(compat),
                           usage="%(prog)s [flags]   (pretrain_gpt.py's flags, by Megatron's groups below)")
    seen: set[str] = set()
    for group in GROUPS:
        section = parser.add_argument_group(group)
        for f in flags:
            if f.group != group:
                continue
            if seen & set(f.names):
                raise ValueError(f"{sorted(seen & set(f.names))} declared twice")
            seen.update(f.names)
            section.add_argument(*f.names, **f.argparse_kwargs())
    for c in compat:
        if c.name in seen:
            raise ValueError(f"{c.name} is both a flag and in the compatibility table")
        seen.add(c.name)
        if c.kind == "switch":
            parser.add_argument(c.name, action="store_true", dest=c.dest, help=argparse.SUPPRESS)
        elif c.kind == "value":
            parser.add_argument(c.name, default=None, dest=c.dest, help=argparse.SUPPRESS)
    return parser

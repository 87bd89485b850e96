"""Options as frozen dataclasses: each flag, its default and its help are written once, on the field.

    @dataclass(frozen=True)
    class ExpertOptions(ServiceOptions):
        shard: str = option("", "I/N: this worker holds shard I of N", required=True)

`add_options` turns the fields into argparse flags (nested option dataclasses are flattened, so
`RouterOptions.sched.max_batch_size` is `--max-batch-size`), `from_args` builds the dataclass back from the
parsed namespace (its `__post_init__` validates), and `to_argv` renders an instance as the flags that
rebuild it, which is how `colibri serve` hands options to its children. Torch-free, so `--help` is fast.
The options every service shares, and the checks of their values, are in options.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import numbers
import os
import re
import sys
import types
import typing
from dataclasses import dataclass
from typing import Any


def option(default: Any, help: str, *, flag: str | None = None, choices: tuple[Any, ...] | None = None,
           metavar: str | None = None, required: bool = False, type: Any = None) -> Any:
    """A dataclass field that is also a command-line flag (`--name-with-dashes` unless `flag` says)."""
    meta = {"help": help, "flag": flag, "choices": choices, "metavar": metavar, "required": required, "type": type}
    return dataclasses.field(default=default, metadata={"cli": meta})


def comma_list(text: str) -> list[str]:
    """The items of a comma-separated list, stripped; [] for a blank one. An empty item among others ("1,,2",
    "a:1,$UNSET") is an error, not dropped."""
    parts = [part.strip() for part in text.split(",")]
    if any(parts) and not all(parts):
        raise argparse.ArgumentTypeError(f"{text!r} holds an empty item (an unset variable, or two commas in a "
                                         f"row?): give each item, or leave the flag out for its default")
    return [part for part in parts if part]


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", ",": ","}


def escaped_list(text: str) -> tuple[str, ...]:
    """Comma-separated strings kept as typed (a stop string may be " the" or a newline), with escapes for what
    a shell makes awkward: \\n \\t \\r, \\, for a comma inside one, \\\\ for a backslash. An empty string,
    or an empty item ("a,,b", an unset variable), is an error: it would match everywhere or nowhere."""
    items, cur, chars = [], [], iter(text)
    for ch in chars:
        if ch == "\\":
            nxt = next(chars, "")
            if not nxt:
                raise argparse.ArgumentTypeError(f"{text!r} ends in a lone backslash: write \\\\ for a backslash")
            if nxt not in _ESCAPES:
                raise argparse.ArgumentTypeError(f"unknown escape '\\{nxt}' in {text!r}: use \\n \\t \\r "
                                                 f"\\, (a comma) or \\\\ (a backslash)")
            cur.append(_ESCAPES[nxt])
        elif ch == ",":
            items.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    items.append("".join(cur))
    if not all(items):
        raise argparse.ArgumentTypeError(f"{text!r} holds an empty string (an unset variable, or two commas in "
                                         f"a row?): give non-empty strings, '\\,' for a comma inside one")
    return tuple(items)


escaped_list.__name__ = "comma-separated strings"


def escaped(text: str) -> str:
    """One string as `escaped_list` reads it back (its inverse, for `to_argv`)."""
    return (text.replace("\\", "\\\\").replace(",", "\\,").replace("\n", "\\n").replace("\t", "\\t")
            .replace("\r", "\\r"))


INT64_MAX = 2**63 - 1


def whole_number(text: str) -> int:
    """An int flag: one past int64 (`--kv-cache-mb 99999999999999999999`) is refused here; it was an
    OverflowError traceback where torch or gRPC took it."""
    value = int(text)
    if abs(value) > INT64_MAX:
        raise argparse.ArgumentTypeError(f"{text} is past the largest whole number a flag takes (2**63 - 1)")
    return value


whole_number.__name__ = "int"       # argparse's "invalid int value: 'x'"


def seed_number(text: str) -> int:
    """A seed flag: a whole number in [0, 2**64), the range a request's seed has on the wire (uint64); past
    whole_number's int64 bound, which had refused [2**63, 2**64) in words that contradicted the seed's own."""
    value = int(text)
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"{text}: a seed is a whole number in [0, 2**64)")
    return value


seed_number.__name__ = "int"


def upper(text: str) -> str:
    return text.upper()


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: what is wrong and where the help is, no usage dump. `given` is the command
    line, for the flag a missing required one was likely misspelled as; a value such as `--shard -1/2` is a
    value, not a flag (argparse said "expected one argument")."""

    given: tuple[str, ...] = ()

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._negative_number_matcher = re.compile(r"^-\.?\d")     # as Python 3.13's: -1/2, -1e-3 are values

    def error(self, message: str) -> typing.NoReturn:
        prefix = "the following arguments are required: "
        if message.startswith(prefix):      # a missing required flag, and a flag typed that resembles it
            known = {s for a in self._actions for s in a.option_strings}
            typed = [w.split("=")[0] for w in self.given if w.startswith("--") and w.split("=")[0] not in known]
            pairs = [(m, t) for m in message.removeprefix(prefix).split(", ")
                     for t in difflib.get_close_matches(m, typed, n=1)]
            if pairs:
                message += " (did you mean " + ", ".join(f"{m} for {t}" for m, t in pairs) + "?)"
        sys.stderr.write(f"{self.prog}: error: {message} (see '{self.prog} --help')\n")
        sys.exit(2)


def _is_options(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _strip_optional(tp: Any) -> Any:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"option type {tp}: only X | None unions are supported")
        return args[0]
    return tp


def _parser_of(tp: Any) -> Any:
    """The argparse `type` of a field: int, float, str, or a comma-separated tuple of them."""
    if typing.get_origin(tp) is tuple:
        item = _parser_of(typing.get_args(tp)[0])

        def parse(text: str) -> tuple[Any, ...]:
            parts = comma_list(text)
            if not parts:                               # `--flag "$UNSET"` would silently mean the default
                raise argparse.ArgumentTypeError(f"{text!r} lists nothing (an unset variable?): give at least one "
                                                 f"item, or leave the flag out for its default")
            return tuple(item(part) for part in parts)

        parse.__name__ = f"comma-separated {item.__name__}"     # argparse names it in its error message
        return parse
    return whole_number if tp is int else tp


@dataclass(frozen=True)
class _Flag:
    path: str                   # "sched.max_batch_size"
    field: dataclasses.Field
    type: Any                   # the field's type without "| None"
    default: Any                # the value in the default instance of the outermost options class

    @property
    def dest(self) -> str:
        return self.path.replace(".", "__")

    @property
    def name(self) -> str:
        return self.field.metadata["cli"]["flag"] or "--" + self.field.name.replace("_", "-")


def _flags(cls: type, exclude: tuple[str, ...] = (), prefix: str = "", defaults: Any = None) -> list[_Flag]:
    """Every flag field of `cls`, nested option dataclasses flattened. A nested field's default is read from
    its parent's default instance, so `sched: SchedulerConfig = SchedulerConfig(max_waiting=8)` is honoured."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        path, tp = prefix + f.name, _strip_optional(hints[f.name])
        if path in exclude:
            continue
        if f.default is dataclasses.MISSING:
            raise TypeError(f"option {path} needs a plain default (no default_factory)")
        default = f.default if defaults is None else getattr(defaults, f.name)
        if _is_options(tp):
            out += _flags(tp, exclude, path + ".", default)
        elif "cli" in f.metadata:
            out.append(_Flag(path, f, tp, default))
    return out


def add_options(parser: argparse.ArgumentParser, cls: type, exclude: tuple[str, ...] = (),
                helps: dict[str, str] | None = None) -> None:
    """One flag per field (argparse refuses two fields that would make the same flag); `helps` replaces the
    help of some paths where a command gives a flag another meaning."""
    for flag in _flags(cls, exclude):
        meta = flag.field.metadata["cli"]
        help_text = (helps or {}).get(flag.path, meta["help"]).replace("%", "%%")
        kw: dict[str, Any] = {"dest": flag.dest, "default": flag.default}
        if flag.type is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw.update(type=meta["type"] or _parser_of(flag.type), choices=meta["choices"],
                      metavar=None if meta["choices"] else meta["metavar"] or flag.field.name.upper())
        if not flag.name.startswith("-"):       # a positional word (`colibri workers ... show`): its dest is its name
            del kw["dest"]
            parser.add_argument(flag.dest, nargs="?" if not meta["required"] else None, help=help_text, **kw)
            continue
        if meta["required"]:
            kw["required"] = True
        elif flag.default not in (None, "", ()) and flag.type is not bool:
            help_text += " (default: %(default)s)"
        parser.add_argument(flag.name, help=help_text, **kw)


def from_args(cls: type, ns: argparse.Namespace, prefix: str = "") -> Any:
    """Build `cls` from parsed flags (its `__post_init__` validates); excluded fields keep their defaults."""
    hints = typing.get_type_hints(cls)
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        path = prefix + f.name
        if _is_options(_strip_optional(hints[f.name])):
            kw[f.name] = from_args(_strip_optional(hints[f.name]), ns, path + ".")
        elif hasattr(ns, path.replace(".", "__")):
            kw[f.name] = value = getattr(ns, path.replace(".", "__"))
            cli = f.metadata.get("cli", {})
            if cli.get("required") and isinstance(value, str) and not value.strip():   # "$UNSET" on a command line
                name = cli.get("flag") or "--" + f.name.replace("_", "-")
                raise ValueError(f"{name} is empty (an unset variable?): it needs a value")
    return cls(**kw)


def _as_field(value: Any, tp: Any) -> tuple[bool, Any]:
    """(whether a keyword value fits a flag field's type, the value as the field holds it): a path for a str, any
    integer (numpy's too) for an int, any real for a float, 0 / 1 for a bool, a list for a tuple; a bool is no
    number."""
    if typing.get_origin(tp) is tuple:
        item = typing.get_args(tp)[0]
        if not isinstance(value, (tuple, list)):
            return False, value
        items = [_as_field(v, item) for v in value]
        return all(ok for ok, _ in items), tuple(v for _, v in items)
    if tp is str and isinstance(value, os.PathLike):
        return True, os.fspath(value)
    if tp is bool:
        return (True, bool(value)) if isinstance(value, bool) or (isinstance(value, numbers.Integral)
                                                                  and value in (0, 1)) else (False, value)
    if isinstance(value, bool):                  # a bool is no number, no string, no path
        return False, value
    if tp is int:
        return (True, int(value)) if isinstance(value, numbers.Integral) else (False, value)
    if tp is float:
        return (True, float(value)) if isinstance(value, numbers.Real) else (False, value)
    return (isinstance(value, tp) if isinstance(tp, type) else True), value


def check_values(cls: type, values: dict[str, Any], where: str) -> dict[str, Any]:
    """Keyword values for `cls`'s flag fields checked as the flags' parser would: the field's type and its choices
    (the Python API skips argparse: dtype="BFLOAT16" was an AttributeError deep in torch, threads="two" a
    comparison error, dtype="float16" silently taken). The values as the fields hold them (`_as_field`), or a
    TypeError / ValueError naming the option."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    out = dict(values)
    for name, value in values.items():
        f = fields.get(name)
        if f is None or "cli" not in f.metadata or (value is None and _strip_optional(hints[name]) is not
                                                     hints[name]):
            continue
        tp, meta = _strip_optional(hints[name]), f.metadata["cli"]
        ok, value = _as_field(value, tp)
        if not ok:
            kind = getattr(tp, "__name__", str(tp))
            raise TypeError(f"{where}: {name} must be {kind}, got {values[name]!r}")
        out[name] = value
        if tp is int and abs(value) > INT64_MAX:
            raise ValueError(f"{where}: {name}={value} is past the largest whole number an option takes (2**63 - 1)")
        if meta["choices"]:
            as_flag = meta["type"](value) if meta["type"] and isinstance(value, str) else value
            if as_flag not in meta["choices"]:
                raise ValueError(f"{where}: {name}={value!r} is not one of {', '.join(map(str, meta['choices']))}")
            out[name] = as_flag
    return out


def to_argv(opts: Any, exclude: tuple[str, ...] = ()) -> list[str]:
    """The flags (`--name=value`) that rebuild `opts` in a child process: the values that differ from the
    defaults, and the required ones."""
    out: list[str] = []
    for flag in _flags(type(opts), exclude):
        value: Any = opts
        for part in flag.path.split("."):
            value = getattr(value, part)
        if value == flag.default and not flag.field.metadata["cli"]["required"]:
            continue
        if value is None:
            raise ValueError(f"{flag.name} is None but defaults to {flag.default!r}: no flag can say None")
        if flag.type is bool:
            out.append(flag.name if value else "--no-" + flag.name[2:])
        elif isinstance(value, tuple):
            escape = flag.field.metadata["cli"]["type"] is escaped_list
            out.append(f"{flag.name}={','.join(escaped(v) if escape else str(v) for v in value)}")
        else:
            out.append(f"{flag.name}={value}")
    return out

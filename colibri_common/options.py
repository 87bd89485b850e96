"""Options as frozen dataclasses: each flag, its default and its help are written once, on the field.

    @dataclass(frozen=True)
    class ExpertOptions(ServiceOptions):
        shard: str = option("", "I/N: this worker holds shard I of N", required=True)

`add_options` turns the fields into argparse flags (nested option dataclasses are flattened, so
`RouterOptions.sched.max_batch_size` is `--max-batch-size`), `from_args` builds the dataclass back from the
parsed namespace (its `__post_init__` validates), and `to_argv` renders an instance as the flags that
rebuild it, which is how `colibri serve` hands options to its children. Torch-free, so `--help` is fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from dataclasses import dataclass
from typing import Any

DTYPES = ("float32", "bfloat16")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def option(default: Any, help: str, *, flag: str | None = None, choices: tuple[Any, ...] | None = None,
           metavar: str | None = None, required: bool = False, type: Any = None) -> Any:
    """A dataclass field that is also a command-line flag (`--name-with-dashes` unless `flag` says)."""
    meta = {"help": help, "flag": flag, "choices": choices, "metavar": metavar, "required": required, "type": type}
    return dataclasses.field(default=default, metadata={"cli": meta})


def comma_list(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def upper(text: str) -> str:
    return text.upper()


@dataclass(frozen=True)
class ServiceOptions:
    """What every Colibri service process takes."""

    model: str = option("", "Hugging Face checkpoint directory (config.json, *.safetensors)", required=True,
                        metavar="DIR")
    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(0, "port; 0 picks a free one")
    dtype: str = option("float32", "compute dtype", choices=DTYPES)
    threads: int = option(0, "torch threads for this process (0 = all cores)")
    log_level: str = option("INFO", "log level", choices=LOG_LEVELS, type=upper)

    def __post_init__(self) -> None:
        if self.threads < 0:
            raise ValueError(f"--threads must be >= 0, got {self.threads}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: what is wrong and where the help is, no usage dump."""

    def error(self, message: str) -> typing.NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message} (see '{self.prog} --help')\n")
        sys.exit(2)


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_options(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _scalar(tp: Any) -> Any:
    """int | None -> int; tuple[str, ...] -> comma_list."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _scalar(args[0])
    if typing.get_origin(tp) is tuple:
        return comma_list
    return tp


def _walk(cls: type, exclude: frozenset[str], prefix: str = ""):
    """(path, field, type) of every flag field, nested option dataclasses flattened."""
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        path = prefix + f.name
        if path in exclude:
            continue
        if _is_options(hints[f.name]):
            yield from _walk(hints[f.name], exclude, path + ".")
        elif "cli" in f.metadata:
            yield path, f, hints[f.name]


def flag_name(f: dataclasses.Field) -> str:
    return f.metadata["cli"]["flag"] or "--" + f.name.replace("_", "-")


def add_options(parser: argparse.ArgumentParser, cls: type, exclude: tuple[str, ...] = ()) -> None:
    for path, f, tp in _walk(cls, frozenset(exclude)):
        meta = f.metadata["cli"]
        kw: dict[str, Any] = {"dest": path.replace(".", "__"), "help": meta["help"]}
        if not meta["choices"] and tp is not bool:
            kw["metavar"] = meta["metavar"] or f.name.upper()
        if tp is bool:
            kw.update(action=argparse.BooleanOptionalAction, default=f.default)
        else:
            kw.update(type=meta["type"] or _scalar(tp), default=f.default, choices=meta["choices"])
        if meta["required"]:
            kw["required"] = True
        elif f.default not in (None, "", ()) and tp is not bool:
            kw["help"] += " (default: %(default)s)"
        parser.add_argument(flag_name(f), **kw)


def from_args(cls: type, ns: argparse.Namespace, prefix: str = "", **overrides: Any) -> Any:
    """Build `cls` from parsed flags; fields without a flag (excluded) keep their defaults."""
    hints = _hints(cls)
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        path = prefix + f.name
        if f.name in overrides:
            kw[f.name] = overrides[f.name]
        elif _is_options(hints[f.name]):
            kw[f.name] = from_args(hints[f.name], ns, path + ".")
        elif hasattr(ns, path.replace(".", "__")):
            kw[f.name] = getattr(ns, path.replace(".", "__"))
    return cls(**kw)


def to_argv(opts: Any, exclude: tuple[str, ...] = ()) -> list[str]:
    """The flags that rebuild `opts` in a child process (only values that differ from the defaults)."""
    out: list[str] = []
    for path, f, tp in _walk(type(opts), frozenset(exclude)):
        value: Any = opts
        for part in path.split("."):
            value = getattr(value, part)
        if value == f.default and not f.metadata["cli"]["required"]:
            continue
        name = flag_name(f)
        if tp is bool:
            out.append(name if value else "--no-" + name[2:])
        elif isinstance(value, tuple):
            out += [name, ",".join(value)]
        else:
            out += [name, str(value)]
    return out


def shared_fields(opts: ServiceOptions) -> dict[str, Any]:
    """The ServiceOptions part of any service's options, to build another service's options from."""
    return {f.name: getattr(opts, f.name) for f in dataclasses.fields(ServiceOptions)}

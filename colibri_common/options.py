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
import numbers
import os
import re
import sys
import types
import typing
from dataclasses import dataclass
from typing import Any

DTYPES = ("float32", "bfloat16")
DTYPE_CHOICES = ("auto", *DTYPES)       # --dtype: auto = as the checkpoint (serving_dtype)


def serving_dtype(asked: str, checkpoint_dtype: str) -> str:
    """The compute dtype a --dtype means for a checkpoint whose config.json says `checkpoint_dtype`: `auto` is
    float32 for a float32 checkpoint and bfloat16 for the others (bfloat16, float16, and FP8 or MXFP4 ones,
    which say bfloat16): its weights held at their size, as vLLM's --dtype auto, not upcast to twice it."""
    if asked != "auto":
        return asked
    return "float32" if checkpoint_dtype in ("float32", "float") else "bfloat16"
QUANTIZE = ("int8", "w8a8")         # as kernels.formats.int8.QUANTIZE_MODES (this module stays torch-free)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
DEVICE_SYNTAX = re.compile(r"^(cpu|cuda(:\d+)?)$")


def option(default: Any, help: str, *, flag: str | None = None, choices: tuple[Any, ...] | None = None,
           metavar: str | None = None, required: bool = False, type: Any = None) -> Any:
    """A dataclass field that is also a command-line flag (`--name-with-dashes` unless `flag` says)."""
    meta = {"help": help, "flag": flag, "choices": choices, "metavar": metavar, "required": required, "type": type}
    return dataclasses.field(default=default, metadata={"cli": meta})


def comma_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


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


def upper(text: str) -> str:
    return text.upper()


@dataclass(frozen=True)
class ServiceOptions:
    """What every Colibri service process takes."""

    model: str = option("", "Hugging Face checkpoint directory (config.json, *.safetensors)", required=True,
                        metavar="DIR")
    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(0, "port; 0 picks a free one")
    dtype: str = option("auto", "compute dtype: auto = the checkpoint's (config.json's torch_dtype): float32 for "
                                "a float32 checkpoint, bfloat16 for bfloat16, float16, FP8 and MXFP4 ones; "
                                "float32 on a bfloat16 checkpoint holds its weights at twice their size",
                        choices=DTYPE_CHOICES)
    threads: int = option(0, "torch threads for this process (0 = all cores)")
    log_level: str = option("INFO", "log level", choices=LOG_LEVELS, type=upper)
    quantize: str | None = option(None, "the routed experts as symmetric per-output-channel int8 weights with "
                                        "float32 scales, made at load time from the checkpoint: int8 = weight-only "
                                        "(the activations keep the compute dtype); w8a8 = the activations are "
                                        "quantised per token to int8 too (int8 x int8 products, int32 sums: faster "
                                        "where the CPU has VNNI, less accurate). The router checks that its "
                                        "workers serve what it was told", choices=QUANTIZE)
    device: str = option("cpu", "compute device: cpu, cuda or cuda:N (a worker's experts and their compute, a "
                                "router's weights, KV cache and compute go there; only the wire stays on the "
                                "host)", metavar="cpu|cuda[:N]")
    tls_cert: str | None = option(None, "PEM certificate: serve TLS only (a router also shows it to its workers "
                                        "as its client certificate)", metavar="PATH")
    tls_key: str | None = option(None, "PEM private key of --tls-cert", metavar="PATH")
    tls_ca: str | None = option(None, "PEM CA that signs the peers' certificates: a worker refuses callers "
                                      "without one (mutual TLS); the router verifies its workers with it",
                                metavar="PATH")
    batch_invariant: bool = option(False, "a request's tokens do not depend on what else is in its batch or when "
                                          "it arrived: every token's row is computed alone (one-row kernels, "
                                          "attention over its exact context), the MoE sum exactly; slower (see "
                                          "docs/models.md). Router and workers must agree; CPU only")
    cpu_forms: str = option("auto", "JSON file of the CPU linear forms measured on this machine, written on the "
                                    "first start and reused after ('auto' = cpu-forms.json in $COLIBRI_CACHE_DIR, "
                                    "$XDG_CACHE_HOME/colibri or ~/.cache/colibri; 'off' = built-in defaults, no "
                                    "measurement)",
                            metavar="PATH|auto|off")

    def dtype_for(self, checkpoint_dtype: str) -> str:
        """The compute dtype's name for a checkpoint whose config.json says `checkpoint_dtype` (--dtype auto)."""
        return serving_dtype(self.dtype, checkpoint_dtype)

    def __post_init__(self) -> None:
        check_threads(self.threads)
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("give --tls-cert and --tls-key together (this service's certificate and its key)")
        if not DEVICE_SYNTAX.match(self.device):
            raise ValueError(f"--device '{self.device}' is not a device; use cpu, cuda or cuda:N")
        if self.quantize is not None and self.device != "cpu":
            raise ValueError(f"--quantize {self.quantize} is the CPU path (int8 CPU kernels); on a GPU serve bfloat16 "
                             f"experts")
        if self.batch_invariant and self.device != "cpu":
            raise ValueError("--batch-invariant runs on CPUs (one-row kernels); on a GPU the Triton kernels' tiles "
                             "depend on the batch: serve without it")


@dataclass(frozen=True)
class ClientTls:
    """How a client (`colibri generate`, `colibri bench`) reaches a router that serves TLS (the chart's default)."""

    tls_ca: str | None = option(None, "PEM CA of the router's certificate: TLS when given (`serve --tls-self-signed` "
                                      "logs where its ca.pem is)", metavar="PATH")
    tls_cert: str | None = option(None, "PEM client certificate, for a router started with --tls-client-auth",
                                  metavar="PATH")
    tls_key: str | None = option(None, "PEM key of --tls-cert", metavar="PATH")

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("give --tls-cert and --tls-key together (a client certificate and its key)")
        if (self.tls_cert or self.tls_key) and not self.tls_ca:
            raise ValueError("--tls-cert/--tls-key need --tls-ca (the router's CA): TLS is on only with it")

    def hint(self, details: str) -> str:
        """What an unreachable router's error leaves out: a plaintext call to a TLS router, or a call without the
        client certificate a --tls-client-auth router requires, ends in "Socket closed" and nothing more."""
        text = details.lower()
        if not ("socket closed" in text or "ssl" in text or "handshake" in text or "certificate" in text):
            return ""
        if not self.tls_ca:
            return " (does the router serve TLS? give its CA with --tls-ca)"
        return "" if self.tls_cert else " (does the router require a client certificate? give --tls-cert and " \
            "--tls-key)"


def check_threads(threads: int) -> None:
    """--threads: 0 (all cores) or a count this machine can run; a ValueError that says so otherwise."""
    if threads < 0:
        raise ValueError(f"--threads must be >= 0, got {threads}")
    cores = os.cpu_count() or 1
    if threads > 4 * cores:                      # each is a kernel thread; 100000 exhausted the machine's threads
        raise ValueError(f"--threads {threads} is more than 4 x this machine's {cores} cores; give at most {cores} "
                         f"(0 = all of them)")


def is_address(text: str) -> bool:
    """HOST:PORT with a host and a port in 1..65535 ([v6]:PORT too, bracketed: ::1 alone would read as host ':'):
    an expert worker's address."""
    host, _, port = text.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]") and len(host) > 2
    return bool(host) and (bracketed or ":" not in host and "[" not in host) and port.isdigit() and \
        0 < int(port) < 65536


def check_target(flag: str, value: str) -> None:
    """A gRPC address a client dials: a HOST:PORT's port in 1..65535 (gRPC dialled 99999 as 34463); other gRPC
    target forms (unix:PATH, dns:///...) pass as they are. An empty one (an unset variable: gRPC failed with its
    internal trace) is refused by `from_args`, as every required flag given empty."""
    found = re.fullmatch(r"(.*):(\d+)", value)
    if found and not 0 < int(found.group(2)) < 65536:
        raise ValueError(f"{flag} {value}: the port must be in 1..65535")
    if value and not found and ":" not in value:   # gRPC dialled a bare host on port 443
        raise ValueError(f"{flag} {value}: give HOST:PORT (the port the router's or serve's `ready` line names)")


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: what is wrong and where the help is, no usage dump."""

    def error(self, message: str) -> typing.NoReturn:
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
        item = typing.get_args(tp)[0]

        def parse(text: str) -> tuple[Any, ...]:
            parts = comma_list(text)
            if not parts:                               # `--flag "$UNSET"` would silently mean the default
                raise argparse.ArgumentTypeError(f"{text!r} lists nothing (an unset variable?): give at least one "
                                                 f"item, or leave the flag out for its default")
            return tuple(item(part) for part in parts)

        parse.__name__ = f"comma-separated {item.__name__}"     # argparse names it in its error message
        return parse
    return tp


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
def shared_fields(opts: ServiceOptions) -> dict[str, Any]:
    """The ServiceOptions part of any service's options, to build another service's options from."""
    return {f.name: getattr(opts, f.name) for f in dataclasses.fields(ServiceOptions)}

"""The options every service shares (`ServiceOptions`, a client's `ClientTls`), their value sets (dtypes,
quantize modes, log levels) and the checks of values several commands take (threads, worker addresses, a
router target). The flags machinery (`option`, `add_options`, `from_args`, `to_argv`) is flags.py. Torch-free,
so `--help` is fast.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any

from colibri_common.flags import option, upper

DTYPES = ("float32", "bfloat16")
GRPC_MAX_BYTES = 2**31 - 1      # gRPC's message limits are C ints: a larger one was an OverflowError at start
DTYPE_CHOICES = ("auto", *DTYPES)       # --dtype: auto = as the checkpoint (serving_dtype)


def serving_dtype(asked: str, checkpoint_dtype: str) -> str:
    """The compute dtype a --dtype means for a checkpoint whose config.json says `checkpoint_dtype` (its saved name,
    config.py): `auto` is float32 for a float32 or float64 checkpoint and bfloat16 for the others (bfloat16,
    float16, and FP8 or MXFP4 ones, which say bfloat16): its weights held at their size, as vLLM's --dtype auto, not
    upcast to twice it."""
    if asked != "auto":
        return asked
    return "float32" if checkpoint_dtype in ("float32", "float64") else "bfloat16"


QUANTIZE = ("int8", "w8a8")         # as kernels.formats.int8.QUANTIZE_MODES (this module stays torch-free)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
DEVICE_SYNTAX = re.compile(r"^(cpu|cuda(:\d+)?)$")



@dataclass(frozen=True)
class ServiceOptions:
    """What every Colibri service process takes."""

    model: str = option("", "Hugging Face checkpoint directory (config.json, *.safetensors)", required=True,
                        metavar="DIR")
    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(0, "port; 0 picks a free one")
    dtype: str = option("auto", "compute dtype: auto = the checkpoint's (config.json's torch_dtype, else its "
                                "weights'): float32 for a float32 or float64 checkpoint, bfloat16 for bfloat16, "
                                "float16, FP8 and MXFP4 ones; float32 on a bfloat16 checkpoint holds its weights at "
                                "twice their size",
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
        client certificate a --tls-client-auth router requires, ends in "Socket closed" and nothing more; a target
        that answers HTTP/1 (the OpenAI front's port, a web server) in gRPC's framing error."""
        text = details.lower()
        if "failed parsing http/2" in text:
            return (" (the target answers HTTP/1, not gRPC: the OpenAI front's port or another web server? give the "
                    "router's gRPC port, the one its `ready` line names)")
        if not ("socket closed" in text or "ssl" in text or "handshake" in text or "certificate" in text):
            return ""
        if not self.tls_ca:
            return " (does it serve TLS? give its CA with --tls-ca)"
        return "" if self.tls_cert else " (does it require a client certificate? give --tls-cert and --tls-key)"


def check_threads(threads: int) -> None:
    """--threads: 0 (all cores) or a count this machine can run; a ValueError that says so otherwise."""
    if threads < 0:
        raise ValueError(f"--threads must be >= 0, got {threads}")
    cores = os.cpu_count() or 1
    if threads > 4 * cores:                      # each is a kernel thread; 100000 exhausted the machine's threads
        raise ValueError(f"--threads {threads} is more than 4 x this machine's {cores} cores; give at most {cores} "
                         f"(0 = all of them)")


HOST_NAME = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*\.?")   # a DNS name or an IPv4 address ('a b' was dialled)
_SCHEMES = ("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:", "vsock:", "xds:")   # gRPC's target forms


def is_address(text: str) -> bool:
    """HOST:PORT with a host and a port in 1..65535 ([v6]:PORT too, bracketed: ::1 alone would read as host ':'):
    an expert worker's address."""
    host, _, port = text.rpartition(":")
    bracketed = re.fullmatch(r"\[[0-9A-Fa-f:.]+(%[\w.-]+)?\]", host) is not None
    return (bracketed or HOST_NAME.fullmatch(host) is not None) and port.isdigit() and 0 < int(port) < 65536


def check_target(flag: str, value: str) -> None:
    """A gRPC address a client dials: a HOST:PORT's port in 1..65535 (gRPC dialled 99999 as 34463); other gRPC
    target forms (unix:PATH, dns:///...) pass as they are. An empty one (an unset variable: gRPC failed with its
    internal trace) is refused by `from_args`, as every required flag given empty."""
    found = re.fullmatch(r"(.*):(\d+)", value)
    if found and not 0 < int(found.group(2)) < 65536 and not value.startswith(("unix:", "unix-abstract:")):
        raise ValueError(f"{flag} {value}: the port must be in 1..65535")
    if value.startswith(_SCHEMES):
        return
    v6 = value.startswith("[") or value.count(":") > 1              # [::1], 2001:db8::1: no port after them
    if not found and ":" in value and not v6:                        # h:-5 (dialled 65531), h:port, h:
        raise ValueError(f"{flag} {value}: the port must be in 1..65535")
    if value and not found or (v6 and found and not re.fullmatch(r"\[.*\]:\d+", value)):   # port 443 dialled
        raise ValueError(f"{flag} {value}: give HOST:PORT (the port the router's or serve's `ready` line names"
                         + ("; an IPv6 address in brackets: [::1]:50051)" if v6 else ")"))


def shared_fields(opts: ServiceOptions) -> dict[str, Any]:
    """The ServiceOptions part of any service's options, to build another service's options from."""
    return {f.name: getattr(opts, f.name) for f in dataclasses.fields(ServiceOptions)}

"""The `colibri` command: serve, router, expert, openai, workers, validate, generate, bench, health, tune.

Every command's flags come from its options dataclass (`ServeOptions`, `RouterOptions`, `ExpertOptions`,
`OpenAIOptions`, `ValidateOptions`, `GenerateOptions`, `BenchOptions`, `HealthOptions`): each flag, default and help is
written once, on the field, and the dataclass validates the values. Heavy imports (torch, gRPC) wait until
a command runs, so `--help` and `--version` are instant.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass

from colibri import __version__
from colibri.generate import GenerateOptions
from colibri.health import HealthOptions
from colibri.loadgen import BenchOptions
from colibri.openai_api.options import OpenAIOptions
from colibri.serve_options import ServeOptions
from colibri.tune import TuneOptions
from colibri.validate import ValidateOptions
from colibri.workers import WorkersOptions
from colibri_common.errors import ColibriError
from colibri_common.flags import Parser, add_options, from_args
from colibri_common.heap import importing, skip_exit_collection
from expert_service.options import ExpertOptions
from router_service.api.options import RouterOptions


def _serve(opts: ServeOptions) -> int:
    with importing():                          # (gRPC) the collector off: heap.importing
        from colibri.launcher import serve

    return serve(opts, main)                   # the children run `main` too (forked: colibri/fork.py)


def _router(opts: RouterOptions) -> int:
    with importing():
        from router_service.api.main import serve_router

    return serve_router(opts)


def _expert(opts: ExpertOptions) -> int:
    with importing():
        from expert_service.main import serve_expert

    return serve_expert(opts)


def _openai(opts: OpenAIOptions) -> int:
    with importing():
        from colibri.openai_api.server import run_front

    return run_front(opts)


def _validate(opts: ValidateOptions) -> int:
    from colibri.validate import validate

    for line in validate(opts.model, opts.workers, opts.replicas, opts.quantize, opts.cpu_forms, opts.dtype):
        print(line)
    print("ok")
    return 0


def _generate(opts: GenerateOptions) -> int:
    from colibri.generate import run_generate

    return run_generate(opts)


def _bench(opts: BenchOptions) -> int:
    from colibri.loadgen import run_bench

    return run_bench(opts)


def _workers(opts: WorkersOptions) -> int:
    from colibri.workers import run_workers

    return run_workers(opts)


def _tune(opts: TuneOptions) -> int:
    from colibri.tune import run_tune

    return run_tune(opts)


def _health(opts: HealthOptions) -> int:
    from colibri.health import run_health

    return run_health(opts)


@dataclass(frozen=True)
class Command:
    options: type
    run: Callable[..., int]
    help: str
    description: str | None = None
    exclude: tuple[str, ...] = ()           # option fields that are no flags of this command
    helps: dict[str, str] | None = None     # this command's own help for some shared fields


COMMANDS: dict[str, Command] = {
    "serve": Command(ServeOptions, _serve, "start router + N expert workers on this machine; print 'ready HOST:PORT'",
                     "Start N expert workers and a router as child processes on loopback, split the cores between "
                     "them, print 'ready HOST:PORT' once every service is SERVING, and stop them together.",
                     ServeOptions.EXCLUDED, ServeOptions.HELPS),
    "router": Command(RouterOptions, _router, "run the router alone (Kubernetes)"),
    "expert": Command(ExpertOptions, _expert, "run one expert worker alone (Kubernetes)"),
    "openai": Command(OpenAIOptions, _openai, "an OpenAI-compatible HTTP API in front of a router (stateless)",
                      "Serve /v1/completions, /v1/chat/completions and /v1/models (streamed as server-sent events "
                      "or not), /health and /metrics over HTTP, turning each request into gRPC calls to the "
                      "router at --target. Holds no model: run as many as the traffic needs."),
    "workers": Command(WorkersOptions, _workers, "show or change a router's expert workers while it serves",
                       "Show the expert workers a router serves with (state, experts, load, balance), or change "
                       "them live: `set` / `add` / `remove` plan a new placement, load it on the new owners while "
                       "the old ones serve, switch between two steps and release the old owners (rolled back if a "
                       "worker cannot load); `rebalance` re-plans from the measured load. Uses the router's Admin "
                       "service with the fleet token ($COLIBRI_FLEET_TOKEN)."),
    "validate": Command(ValidateOptions, _validate, "check a checkpoint and size its shards"),
    "generate": Command(GenerateOptions, _generate, "generate from a running router, streaming the text",
                        exclude=GenerateOptions.EXCLUDED),
    "bench": Command(BenchOptions, _bench, "load-test a running router: tok/s, TTFT and ITL percentiles",
                     "A load generator against a running router, like `vllm bench serve`: random prompts of "
                     "--prompt-len token ids, greedy, exactly --max-tokens new tokens each (EOS ignored), "
                     "--concurrency requests in flight until --num-requests are done."),
    "health": Command(HealthOptions, _health, "ask a service's grpc.health.v1 status; exit 0 when SERVING"),
    "tune": Command(TuneOptions, _tune, "measure the CPU linear forms for a model now (else the first start does)",
                    "Time the candidate forms of x @ W.T (matrix-vector, GEMM, float32 upcast) for the model's "
                    "real shapes at 1-64 rows, with the thread counts `serve --workers N` would use, and keep "
                    "the winners where the services look for them."),
}


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="colibri",
                description="Serve Mixture-of-Experts models as a router plus expert workers over gRPC.")
    ap.add_argument("--version", action="version", version=f"colibri {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.description or cmd.help)
        add_options(p, cmd.options, exclude=cmd.exclude, helps=cmd.helps)
    ap.commands = sub.choices  # type: ignore[attr-defined]
    return ap


def command_options(ap: argparse.ArgumentParser, args: argparse.Namespace):
    """The command's options dataclass; a value its validation refuses is a one-line usage error."""
    try:
        return from_args(COMMANDS[args.cmd].options, args)
    except ValueError as exc:
        ap.commands[args.cmd].error(str(exc))  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    words = sys.argv[1:] if argv is None else argv
    for parser in ap.commands.values():  # type: ignore[attr-defined]
        parser.given = tuple(words)
    args, left = ap.parse_known_args(argv)
    if left and left[0] in words and args.cmd in words and words.index(left[0]) < words.index(args.cmd):
        # before the command: colibri's own
        ap.error(f"unrecognized arguments: {' '.join(left)}")
    if left:                                   # said by the command's own parser, with the flag it resembles
        known = [s for a in ap.commands[args.cmd]._actions for s in a.option_strings]  # type: ignore[attr-defined]
        near = difflib.get_close_matches(left[0].split("=")[0], known, n=1)
        ap.commands[args.cmd].error(f"unrecognized arguments: {' '.join(left)}"  # type: ignore[attr-defined]
                                    + (f" (did you mean {near[0]}?)" if near else ""))
    opts = command_options(ap, args)
    try:
        return COMMANDS[args.cmd].run(opts)
    except ColibriError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except PermissionError as exc:             # a checkpoint (or TLS, or temporary) file this user may not read or
        what = f"{exc.filename}: permission denied" if exc.filename else str(exc)          # write: a traceback
        print(f"error: {what} for this process (uid {os.getuid()}); give it access (chmod / chown, or the pod's "
              f"securityContext.fsGroup), or run as a user that has it", file=sys.stderr)
        return 2
    except KeyboardInterrupt:                  # Ctrl-C in a tool (tune, validate, bench): one line, not a traceback
        print(f"colibri {args.cmd}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:                    # `colibri workers show | head`: the reader left, as for any tool
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # (the exit's flush must not fail again)
        return 128 + signal.SIGPIPE


SERVICES = ("serve", "router", "expert", "openai")


def entry() -> None:
    """The console script: `main`, then, for a service that has stopped (its threads joined, its files saved,
    "stopped" logged), exit without the interpreter's module teardown, which costs about a second of a
    restart or a rolling update for nothing."""
    rc = main()
    argv = sys.argv[1:]
    if argv and argv[0] in SERVICES:          # nothing of ours needs teardown: threads are daemons, files saved
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (BrokenPipeError, ValueError):                 # a reader gone: the exit code still counts
                pass
        os._exit(rc)
    skip_exit_collection()
    sys.exit(rc)


if __name__ == "__main__":
    entry()

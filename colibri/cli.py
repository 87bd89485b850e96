"""The `colibri` command: serve, router, expert, validate, generate, bench, health.

The services' flags come from their option dataclasses (`RouterOptions`, `ExpertOptions`, `ServeOptions`):
each flag, default and help is written once, on the field. Heavy imports (torch, gRPC) wait until a
command runs, so `--help` and `--version` are instant.
"""

from __future__ import annotations

import argparse
import json
import sys

from colibri import __version__
from colibri.launcher import ServeOptions
from colibri_common.errors import ColibriError
from colibri_common.options import Parser, add_options, from_args
from expert_service.options import ExpertOptions
from router_service.options import RouterOptions

SERVICES: dict[str, type] = {"serve": ServeOptions, "router": RouterOptions, "expert": ExpertOptions}


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="colibri",
                description="Serve Mixture-of-Experts models as a router plus expert workers over gRPC.")
    ap.add_argument("--version", action="version", version=f"colibri {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    ap.commands = sub.choices  # type: ignore[attr-defined]

    p = sub.add_parser("serve", help="start router + N expert workers on this machine; print 'ready HOST:PORT'",
                       description="Start N expert workers and a router as child processes on loopback, split "
                                   "the cores between them (--threads: cores to split, 0 = all), print "
                                   "'ready HOST:PORT' once every service is SERVING, and stop them together.")
    add_options(p, ServeOptions, exclude=ServeOptions.EXCLUDED)
    p = sub.add_parser("router", help="run the router alone (Kubernetes)")
    add_options(p, RouterOptions)
    p = sub.add_parser("expert", help="run one expert worker alone (Kubernetes)")
    add_options(p, ExpertOptions)

    p = sub.add_parser("validate", help="check a checkpoint and size its shards")
    p.add_argument("--model", required=True, metavar="DIR", help="checkpoint directory")
    p.add_argument("--workers", type=int, default=2, help="size the shards for this many workers "
                                                          "(default: %(default)s)")

    p = sub.add_parser("generate", help="generate from a running router, streaming the text")
    p.add_argument("--target", required=True, help="router address HOST:PORT")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt", help="prompt text (needs the model's tokenizer)")
    g.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    p.add_argument("--max-tokens", type=int, default=32, help="new tokens at most (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, 1 = off (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest, 0 = off (default: %(default)s)")
    p.add_argument("--seed", type=int, default=None, help="seed of this request's sampling (default: random)")
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line")

    p = sub.add_parser("health", help="ask a service's grpc.health.v1 status; exit 0 when SERVING")
    p.add_argument("--target", required=True, help="service address HOST:PORT")
    p.add_argument("--service", default="", help="'' = liveness; colibri.v1.Generation or colibri.v1.ExpertWorker "
                                                 "= readiness (default: liveness)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds (default: %(default)s)")

    from colibri.loadgen import add_bench_parser

    add_bench_parser(sub)
    return ap


def service_options(ap: argparse.ArgumentParser, args: argparse.Namespace):
    """The command's option dataclass; a value its validation refuses is a one-line usage error."""
    try:
        return from_args(SERVICES[args.cmd], args)
    except ValueError as exc:
        ap.commands[args.cmd].error(str(exc))  # type: ignore[attr-defined]


def run(args: argparse.Namespace, opts) -> int:
    if args.cmd == "serve":
        from colibri.launcher import serve

        return serve(opts)
    if args.cmd == "router":
        from router_service.server import serve_router

        serve_router(opts)
        return 0
    if args.cmd == "expert":
        from expert_service.server import serve_expert

        serve_expert(opts)
        return 0
    if args.cmd == "validate":
        from colibri.validate import validate

        for line in validate(args.model, args.workers):
            print(line)
        print("ok")
        return 0
    if args.cmd == "generate":
        return _generate(args)
    if args.cmd == "health":
        return _health(args)
    if args.cmd == "bench":
        from colibri.loadgen import run_bench

        return run_bench(args)
    raise AssertionError(f"unhandled command {args.cmd}")


def _health(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(args.target) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
        except grpc.RpcError as exc:
            print(f"{args.target}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    print(f"{args.target} {args.service or '(liveness)'}: {status}")
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1


def _generate(args: argparse.Namespace) -> int:
    import grpc

    from colibri.client import Client, make_request

    if args.prompt is not None:
        prompt: str | list[int] = args.prompt
    else:
        try:
            prompt = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise ColibriError(f"--prompt-ids must be comma-separated integers, got '{args.prompt_ids}'") from None
    client = Client(args.target)
    req = make_request(prompt, args.max_tokens, temperature=args.temperature, seed=args.seed,
                       top_p=args.top_p, top_k=args.top_k)
    ids, text, reason = [], "", ""
    try:
        for msg in client.stream(req):
            kind = msg.WhichOneof("response")
            if kind == "chunk":
                ids.extend(msg.chunk.token_ids)
                text += msg.chunk.text
                if not args.json:
                    print(msg.chunk.text, end="", flush=True)
            elif kind == "complete":
                reason = msg.complete.finish_reason
    except grpc.RpcError as exc:
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"token_ids": ids, "text": text, "finish_reason": reason}))
    else:
        print()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    opts = service_options(ap, args) if args.cmd in SERVICES else None
    try:
        return run(args, opts)
    except ColibriError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""The `colibri` command: serve, router, expert, validate, generate, bench."""

from __future__ import annotations

import argparse
import json
import sys

from colibri_common.errors import ColibriError

DTYPES = ("float32", "bfloat16")


def _add_service_args(p: argparse.ArgumentParser, default_port: int) -> None:
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory (config.json, *.safetensors)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=default_port, help="port; 0 picks a free one (default: %(default)s)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="compute dtype (default: %(default)s)")
    p.add_argument("--threads", type=int, default=0, help="torch threads for this process (0 = all cores)")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default: %(default)s)")


def _add_router_tuning(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-batch-size", type=int, default=64, help="sequences per step (default: %(default)s)")
    p.add_argument("--max-num-tokens", type=int, default=512,
                   help="tokens (prefill + decode) per step (default: %(default)s)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="bounded waiting queue; beyond it RESOURCE_EXHAUSTED (default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=4096, help="prompt + output tokens (default: %(default)s)")
    p.add_argument("--kv-cache-mb", type=int, default=512, help="KV cache budget in MiB (default: %(default)s)")
    p.add_argument("--wire-dtype", choices=DTYPES, default=None,
                   help="dtype of hidden states on the wire to the workers (default: the compute dtype)")
    p.add_argument("--micro-batches", type=int, default=1,
                   help="split each step into this many micro-batches and overlap the router's attention of "
                        "one with the workers' experts of another (default: %(default)s)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on http://HOST:PORT/metrics (default: off; 0 = any free port)")
    p.add_argument("--transport", choices=("stream", "unary"), default="stream",
                   help="router → worker calls: one bidirectional stream per worker, or unary calls "
                        "(default: %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="colibri",
        description="Serve Mixture-of-Experts models as a router plus expert workers over gRPC.")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    p = sub.add_parser("serve", help="start router + N expert workers on this machine; print 'ready HOST:PORT'")
    _add_service_args(p, 50051)
    p.add_argument("--workers", type=int, default=2, help="number of expert workers (shards) (default: %(default)s)")
    _add_router_tuning(p)

    p = sub.add_parser("router", help="run the router alone (Kubernetes)")
    _add_service_args(p, 50051)
    p.add_argument("--workers", required=True, help="comma-separated worker addresses HOST:PORT,...")
    _add_router_tuning(p)

    p = sub.add_parser("expert", help="run one expert worker alone (Kubernetes)")
    _add_service_args(p, 50061)
    p.add_argument("--shard", required=True, help="I/N: this worker holds shard I of N (0-based)")

    p = sub.add_parser("validate", help="check a checkpoint and size its shards")
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--workers", type=int, default=2, help="size the shards for this many workers")

    p = sub.add_parser("generate", help="generate from a running router, streaming the text")
    p.add_argument("--target", required=True, help="router address HOST:PORT")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt", help="prompt text (needs the model's tokenizer)")
    g.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    p.add_argument("--max-tokens", type=int, default=32, help="new tokens at most (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line")

    p = sub.add_parser("health", help="ask a service's grpc.health.v1 status; exit 0 when SERVING")
    p.add_argument("--target", required=True, help="service address HOST:PORT")
    p.add_argument("--service", default="", help="'' = liveness; colibri.v1.Generation or colibri.v1.ExpertWorker "
                                                 "= readiness (default: liveness)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds (default: %(default)s)")

    from colibri_common.loadgen import add_bench_parser

    add_bench_parser(sub)
    return ap


def _setup_service(args) -> None:
    import torch

    from colibri_common.serving import setup_logging

    setup_logging(args.cmd if args.cmd != "expert" else f"expert[{args.shard}]", args.log_level)
    if args.threads > 0:
        torch.set_num_threads(args.threads)


def _router_opts(args):
    import torch

    from router_service.scheduler import SchedulerConfig
    from router_service.server import RouterOptions

    dt = getattr(torch, args.dtype)
    return RouterOptions(
        dtype=dt, wire_dtype=getattr(torch, args.wire_dtype) if args.wire_dtype else None,
        kv_cache_mb=args.kv_cache_mb, micro_batches=args.micro_batches, transport=args.transport,
        metrics_port=args.metrics_port,
        sched=SchedulerConfig(args.max_batch_size, args.max_num_tokens, args.max_waiting, args.max_model_len))


def _router_passthrough(args) -> list[str]:
    out = ["--max-batch-size", str(args.max_batch_size), "--max-num-tokens", str(args.max_num_tokens),
           "--max-waiting", str(args.max_waiting), "--max-model-len", str(args.max_model_len),
           "--kv-cache-mb", str(args.kv_cache_mb), "--log-level", args.log_level,
           "--micro-batches", str(args.micro_batches), "--transport", args.transport]
    if args.metrics_port is not None:
        out += ["--metrics-port", str(args.metrics_port)]
    return out + (["--wire-dtype", args.wire_dtype] if args.wire_dtype else [])


def run(args) -> int:
    if args.cmd == "serve":
        from colibri_common.launcher import serve
        from colibri_common.serving import setup_logging

        setup_logging("serve", args.log_level)
        return serve(args.model, args.workers, args.host, args.port, args.dtype, _router_passthrough(args),
                     cores=args.threads or None, log_level=args.log_level)
    if args.cmd == "router":
        _setup_service(args)
        from router_service.server import serve_router

        serve_router(args.model, [a for a in args.workers.split(",") if a], args.host, args.port,
                     _router_opts(args))
        return 0
    if args.cmd == "expert":
        _setup_service(args)
        import torch

        from colibri_common.placement import parse_shard
        from expert_service.server import serve_expert

        try:
            shard, n = parse_shard(args.shard)
        except ValueError as exc:
            raise ColibriError(str(exc)) from None
        serve_expert(args.model, shard, n, args.host, args.port, getattr(torch, args.dtype))
        return 0
    if args.cmd == "validate":
        from colibri_common.validate import validate

        for line in validate(args.model, args.workers):
            print(line)
        print("ok")
        return 0
    if args.cmd == "generate":
        return _generate(args)
    if args.cmd == "health":
        return _health(args)
    if args.cmd == "bench":
        from colibri_common.loadgen import run_bench

        return run_bench(args)
    raise AssertionError(args.cmd)


def _health(args) -> int:
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


def _generate(args) -> int:
    import grpc

    from colibri_common.client import Client, make_request

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
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except ColibriError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

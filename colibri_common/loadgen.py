"""`colibri bench`: a load generator against a running router (filled in by the throughput work)."""

from __future__ import annotations

import argparse


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="load-test a running router: tok/s, TTFT and ITL percentiles")
    p.add_argument("--target", required=True, help="router address HOST:PORT")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")


def run_bench(args: argparse.Namespace) -> int:
    raise NotImplementedError

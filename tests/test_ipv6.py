"""A worker and a router that listen on IPv6 (an IPv6 single-stack cluster's pods): `--host ::` had failed to bind
(gRPC took ':::50051' for a domain name), and the metrics server bound IPv4 sockets only."""

from __future__ import annotations

import socket
import subprocess
import urllib.request

import pytest

from colibri.client import Client
from tests.conftest import colibri_popen, free_port


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def started(argv: list[str]) -> tuple[subprocess.Popen, str]:
    p = colibri_popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    line = p.stdout.readline()
    if not line.startswith("ready "):
        _, err = p.communicate(timeout=30)
        raise AssertionError(f"{argv[0]} did not start: {err[-2000:]}")
    return p, line.split()[1]


@pytest.mark.skipif(not ipv6_loopback(), reason="this machine has no IPv6 loopback")
@pytest.mark.parametrize("host", ["::", "::1"])
def test_a_fleet_serves_on_ipv6_addresses(oracles, host):
    oracle = oracles["qwen3_moe"]
    wm, rm = free_port(), free_port()
    procs = []
    try:
        worker, waddr = started(["expert", "--model", str(oracle.path), "--shard", "0/1", "--host", host, "--port", "0",
                                 "--metrics-port", str(wm), "--cpu-forms", "off", "--threads", "1"])
        procs.append(worker)
        assert waddr.startswith(f"[{host}]:"), waddr                      # the ready line names it in brackets
        port = waddr.rsplit(":", 1)[1]
        router, raddr = started(["router", "--model", str(oracle.path), "--workers", f"[::1]:{port}", "--host", host,
                                 "--port", "0", "--metrics-port", str(rm), "--cpu-forms", "off", "--threads", "1"])
        procs.append(router)
        with Client(f"[::1]:{raddr.rsplit(':', 1)[1]}") as client:
            assert client.generate([3, 17, 42], 6).token_ids == oracle.greedy([3, 17, 42], 6)
        for mport in (wm, rm):
            with urllib.request.urlopen(f"http://[::1]:{mport}/metrics", timeout=10) as res:
                assert res.status == 200 and b"colibri" in res.read()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.communicate(timeout=30)

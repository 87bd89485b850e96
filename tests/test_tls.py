"""Mutual TLS between router and workers, TLS to clients: a worker refuses plaintext callers and callers
whose certificate another CA signed; a fleet started with --tls-self-signed serves transformers' tokens."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from pathlib import Path

import grpc
import openai
import pytest

from colibri.cli import build_parser, command_options
from colibri.client import AsyncClient, Client
from colibri_common.errors import ColibriError, ConfigError
from colibri_common.pb import expert_pb2, expert_pb2_grpc
from colibri_common.tls import TlsFiles, client_channel, self_signed
from tests.conftest import colibri_popen, colibri_run, fleet


def describe(channel: grpc.Channel) -> grpc.StatusCode:
    try:
        expert_pb2_grpc.ExpertWorkerStub(channel).Describe(expert_pb2.DescribeRequest(), timeout=10)
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()


def test_a_tls_worker_refuses_callers_its_ca_did_not_sign(oracles, tmp_path):
    ours, theirs = self_signed(tmp_path / "ours"), self_signed(tmp_path / "theirs")
    p = colibri_popen(["expert", "--model", str(oracles["olmoe"].path), "--shard", "0/1", "--port", "0",
                       "--log-level", "ERROR", "--cpu-forms", "off", "--tls-cert", ours.cert, "--tls-key", ours.key,
                       "--tls-ca", ours.ca], stdout=subprocess.PIPE)
    try:
        addr = p.stdout.readline().split()[1]
        with grpc.insecure_channel(addr) as ch:
            assert describe(ch) == grpc.StatusCode.UNAVAILABLE                       # plaintext
        with client_channel(addr, [], ca=ours.ca) as ch:
            assert describe(ch) == grpc.StatusCode.UNAVAILABLE                       # no client certificate
        with client_channel(addr, [], ca=ours.ca, cert=theirs.cert, key=theirs.key) as ch:
            assert describe(ch) == grpc.StatusCode.UNAVAILABLE                       # another CA's certificate
        with client_channel(addr, [], ca=ours.ca, cert=ours.cert, key=ours.key) as ch:
            assert describe(ch) == grpc.StatusCode.OK
        probe = ["health", "--target", addr, "--service", "colibri.v1.ExpertWorker"]
        tls = ["--tls-ca", ours.ca, "--tls-cert", ours.cert, "--tls-key", ours.key, "--tls-server-name", "localhost"]
        assert colibri_run(probe + tls, timeout=60).returncode == 0   # the chart's probe
        assert colibri_run(probe, timeout=60).returncode == 1
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)


def test_tls_flags_that_cannot_work_are_refused_at_start(oracles, tmp_path, capsys):
    tls = self_signed(tmp_path / "ca")
    base = ["expert", "--model", str(oracles["olmoe"].path), "--shard", "0/1", "--port", "0"]
    # One real start: a worker with TLS but no CA exits non-zero with one clear line, no traceback.
    out = colibri_run([*base, "--tls-cert", tls.cert, "--tls-key", tls.key])
    needle = "needs --tls-ca too"
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    assert [line.startswith("error: ") for line in out.stderr.splitlines() if needle in line] == [True], out.stderr
    # The others fail in the same place (the worker's TlsFiles.of, a ColibriError the CLI prints as that one
    # line): checked in-process, from the same flags.
    assert issubclass(ConfigError, ColibriError)
    ap = build_parser()
    opts = command_options(ap, ap.parse_args([*base, "--tls-cert", "/nope.pem", "--tls-key", tls.key, "--tls-ca",
                                              tls.ca]))
    with pytest.raises(ConfigError, match="no such file"):
        TlsFiles.of(opts.tls_cert, opts.tls_key, opts.tls_ca)
    with pytest.raises(ConfigError, match="needs both --tls-cert and --tls-key"):
        TlsFiles.of(tls.cert, None, None)
    # a certificate without its key is refused by the flags' own check, before any file is read: one line, exit 2
    with pytest.raises(SystemExit) as exited:
        command_options(ap, ap.parse_args([*base, "--tls-cert", tls.cert]))
    assert exited.value.code == 2 and "give --tls-cert and --tls-key together" in capsys.readouterr().err


def test_a_client_given_files_that_are_not_pem_says_so_before_dialling(tmp_path):
    """A CA that is not PEM, or a client certificate and a key that are not a pair, were taken by gRPC and failed
    every handshake with its own words; now one ConfigError names the flag and the file, and the command-line
    clients print it as one line (exit 2)."""
    tls, other = self_signed(tmp_path / "a"), self_signed(tmp_path / "b")
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match=f"--tls-ca {junk} holds no PEM certificate"):
        Client("127.0.0.1:1", tls_ca=str(junk))
    with pytest.raises(ConfigError, match="is not the key of --tls-cert"):
        Client("127.0.0.1:1", tls_ca=tls.ca, tls_cert=tls.cert, tls_key=other.key)
    for argv in (["health", "--target", "127.0.0.1:1"], ["workers", "--target", "127.0.0.1:1"]):
        out = colibri_run([*argv, "--tls-ca", str(junk)], timeout=60)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert out.stderr.strip().splitlines()[-1].endswith(f"--tls-ca {junk} holds no PEM certificate "
                                                            f"(NO_CERTIFICATE_OR_CRL_FOUND)"), out.stderr


def test_a_self_signed_fleet_serves_the_same_tokens_over_tls(oracles):
    oracle = oracles["qwen3_moe"]
    with fleet(oracle.path, 2, ["--tls-self-signed", "--tls-client-auth", "--openai-port", "0"]) as (addr, proc):
        (d,) = Path(os.environ["COLIBRI_CACHE_DIR"]).glob(f"tls-*-{proc.pid}")
        ca, cert, key = (str(d / f) for f in ("ca.pem", "cert.pem", "key.pem"))
        client = Client(addr, tls_ca=ca, tls_cert=cert, tls_key=key)
        assert client.generate([1, 2, 3], 8).token_ids == oracle.greedy([1, 2, 3], 8)

        async def over_aio() -> list[int]:
            async with AsyncClient(addr, tls_ca=ca, tls_cert=cert, tls_key=key) as aio:
                return (await aio.generate([1, 2, 3], 8)).token_ids

        assert asyncio.run(over_aio()) == oracle.greedy([1, 2, 3], 8)
        # the command-line clients too (they had no TLS flags: a TLS router, the chart's default, was out of reach)
        files = ["--tls-ca", ca, "--tls-cert", cert, "--tls-key", key]
        gen = colibri_run(["generate", "--target", addr, "--prompt-ids", "1,2,3", "--max-tokens", "8", "--json",
                           *files], timeout=60)
        assert gen.returncode == 0, gen.stderr
        assert json.loads(gen.stdout.strip().splitlines()[-1])["token_ids"] == oracle.greedy([1, 2, 3], 8)
        bench = colibri_run(["bench", "--target", addr, "--concurrency", "2", "--num-requests", "2", "--max-tokens",
                             "4", "--json", *files], timeout=120)
        assert bench.returncode == 0 and json.loads(bench.stdout.strip().splitlines()[-1])["requests_ok"] == 2, \
            bench.stdout + bench.stderr
        plain = colibri_run(["generate", "--target", addr, "--prompt-ids", "1,2,3", "--max-tokens", "2"], timeout=60)
        assert plain.returncode == 1 and "give its CA with --tls-ca" in plain.stderr, plain.stderr
        no_cert = colibri_run(["generate", "--target", addr, "--prompt-ids", "1,2,3", "--max-tokens", "2",
                               "--tls-ca", ca], timeout=60)
        assert no_cert.returncode == 1 and "require a client certificate" in no_cert.stderr, no_cert.stderr
        for extra, hint in (([], "give its CA with --tls-ca"), (["--tls-ca", ca], "give --tls-cert and --tls-key")):
            probe = colibri_run(["health", "--target", addr, *extra], timeout=60)   # said "Socket closed" alone
            assert probe.returncode == 1 and hint in probe.stderr, probe.stderr
        # The HTTP front `serve` started is the router's TLS client (with the client certificate it requires);
        # a model without a tokenizer takes token ids, and its log-probabilities name tokens by id.
        api = openai.OpenAI(base_url=proc.openai, api_key="x", max_retries=0, timeout=60)
        res = api.completions.create(model=oracle.path.name, prompt=[1, 2, 3], max_tokens=8, temperature=0,
                                     logprobs=1)
        assert res.choices[0].logprobs.tokens == [f"token_id:{t}" for t in oracle.greedy([1, 2, 3], 8)]
        with pytest.raises(openai.BadRequestError, match="no tokenizer"):
            api.completions.create(model=oracle.path.name, prompt="text", max_tokens=2)
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            api.chat.completions.create(model=oracle.path.name, messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(grpc.RpcError) as err:
            Client(addr, tls_ca=ca).generate([1, 2, 3], 2, timeout=10)           # --tls-client-auth: no cert, no
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as err:
            Client(addr).generate([1, 2, 3], 2, timeout=10)                        # plaintext to a TLS router
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert d.stat().st_mode & 0o777 == 0o700
    assert not d.exists()                                                         # the throw-away key is gone

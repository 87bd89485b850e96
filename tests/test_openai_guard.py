"""The HTTP front's guard against a real fleet: the API key (handed by `colibri serve` to its front through the
environment), Host names (DNS rebinding), JSON bodies only, CORS only for --allowed-origins, no path or address
in what it tells, HTTP/1.0 streaming refused clearly; and bad header values that never crash it."""

from __future__ import annotations

import gzip
import json
import os
import re
import socket
import subprocess
import time
from contextlib import contextmanager

import openai
import psutil
import pytest

from colibri.client import Client
from colibri.openai_api.guard import refusal
from colibri.openai_api.options import OpenAIOptions
from colibri.openai_api.policy import API_KEY_ENV, Policy, api_key, host_entry, host_name, origin_of
from tests.chat_fixtures import chat_checkpoint
from tests.conftest import argv_of, colibri_popen, fleet
from tests.test_openai_connection_rules import talk
from tests.test_replicas import port_of, workers_of

KEY = "sk-colibri-test-6f1c2b"
PAGE = "https://app.example"
COMPLETION = {"model": "chatty", "prompt": "Hi", "max_tokens": 2}

# ------------------------------------------------------------------------------------------- the rules alone


def test_host_names_are_normalised_as_browsers_send_them():
    assert host_name("Example.COM.:8000") == "example.com"
    assert host_name("[0:0:0:0:0:0:0:1]:80") == host_name("[::1]") == "::1"
    assert host_name("127.0.0.1:") == "127.0.0.1"
    for junk in ("", "[", "[::1", "[zz]", "a:b:c", "::1", "h\xfest", "a b", "x:80x", "[::1]x"):
        assert host_name(junk) is None, junk
    assert [host_entry(e) for e in ("::1", "[::1]:8000", "LOCALHOST", "*.Example.com", "*")] == [
        "::1", "::1", "localhost", "*.example.com", "*"]
    for bad in ("http://x/", "*.", "a b", "*x.com", ""):
        with pytest.raises(ValueError, match="--allowed-hosts"):
            host_entry(bad)


def test_default_hosts_are_the_bound_address_and_loopback_and_on_a_wildcard_this_machine():
    here = Policy.of(OpenAIOptions(target="r:1"), "127.0.0.1")
    assert all(here.host_ok(h) for h in ("localhost:8000", "127.0.0.1", "[::1]:1", "LocalHost."))
    assert not here.host_ok("evil.example") and not here.host_ok(socket.gethostname() + ".invalid")
    wide = Policy.of(OpenAIOptions(target="r:1", host="0.0.0.0"), "0.0.0.0")
    assert wide.host_ok(socket.gethostname()) and wide.host_ok("127.0.0.1") and not wide.host_ok("evil.example")
    named = Policy.of(OpenAIOptions(target="r:1", allowed_hosts=("api.example.com", "*.svc.cluster.local")), "::1")
    assert named.host_ok("api.example.com:443") and named.host_ok("front.ns.svc.cluster.local")
    assert not named.host_ok("svc.cluster.local") and not named.host_ok("localhost")     # the list replaces
    assert Policy.of(OpenAIOptions(target="r:1", allowed_hosts=("*",)), "::1").host_ok("anything.example")


def test_origins_keys_and_their_bad_values():
    assert origin_of("HTTPS://App.Example:443/") == PAGE and origin_of("http://a.b:8080") == "http://a.b:8080"
    assert origin_of("null") is None and origin_of("https://a.b/path") is None
    for bad in ("app.example", "ftp://a.b", "https://a.b/x"):
        with pytest.raises(ValueError, match="--allowed-origins"):
            OpenAIOptions(target="r:1", allowed_origins=(bad,))
    with pytest.raises(ValueError, match="--api-key must be printable ASCII") as err:
        OpenAIOptions(target="r:1", api_key="two words")
    assert "two words" not in str(err.value)                              # a refused key is not echoed
    with pytest.raises(ValueError, match="--api-key is empty"):          # "$UNSET": not an open front
        OpenAIOptions(target="r:1", api_key=" ")
    opts = OpenAIOptions(target="r:1", api_key=KEY)
    assert KEY not in repr(opts)
    assert api_key(opts, {API_KEY_ENV: "other"}) == (KEY, "--api-key")    # the flag wins
    assert api_key(OpenAIOptions(target="r:1"), {API_KEY_ENV: f" {KEY}\n"}) == (KEY, f"${API_KEY_ENV}")
    assert api_key(OpenAIOptions(target="r:1"), {}) == ("", "")
    with pytest.raises(ValueError, match=API_KEY_ENV):
        api_key(OpenAIOptions(target="r:1"), {API_KEY_ENV: "a\tb"})
    policy = Policy.of(opts, "127.0.0.1", KEY)
    assert policy.key_ok(KEY.encode()) and not policy.key_ok(KEY.encode()[:-1]) and not policy.key_ok(b"")


def test_refusals_come_in_order_host_then_key_then_content_type():
    policy = Policy.of(OpenAIOptions(target="r:1"), "127.0.0.1", KEY)

    def why(method="POST", path="/v1/completions", **headers):
        raw = {k.replace("_", "-").encode(): [v.encode("latin-1")] for k, v in headers.items()}
        err = refusal({"method": method, "path": path}, raw, policy)
        return None if err is None else err.status

    ok = {"host": "localhost", "authorization": f"Bearer {KEY}", "content_type": "application/json"}
    assert why(**ok) is None
    assert why(**{**ok, "host": "evil.example", "authorization": ""}) == 421
    assert why(**{**ok, "authorization": "bearer " + KEY}) is None                # the scheme is case-blind
    assert why(**{**ok, "authorization": "Basic " + KEY}) == 401
    assert why(**{**ok, "content_type": "text/plain"}) == 415
    assert why(**{**ok, "content_type": "Application/JSON; charset=UTF-8"}) is None
    assert why(**{**ok, "content_type": "application/json; charset=latin-1"}) == 415
    assert why("GET", "/health", host="localhost") is None                       # probes carry no key
    assert why("GET", "/metrics", host="localhost") == 401


# ------------------------------------------------------------------------------------------- a real fleet


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """`colibri serve --openai-port 0` with $COLIBRI_API_KEY set: (checkpoint path, router address, front port,
    serve's process)."""
    path = tmp_path_factory.mktemp("guard") / "chatty"
    chat_checkpoint(path)
    with fleet(path, 1, ["--openai-port", "0", "--max-model-len", "64"], env={API_KEY_ENV: KEY}) as (addr, proc):
        yield path, addr, int(proc.openai.rsplit(":", 1)[1].split("/")[0]), proc


def exchange(port: int, method: str, path: str, headers: dict[str, str] | list[tuple[str, str]] | None = None,
             body: bytes = b"", version: str = "1.1") -> tuple[int, dict[str, str], bytes]:
    """One request on a raw socket, read to the close: (status, headers with lower-case names, body). Host, the
    key and the content type are right unless `headers` says otherwise (a value None drops that header)."""
    base = {"Host": f"127.0.0.1:{port}", "Authorization": f"Bearer {KEY}", "Connection": "close"}
    if method == "POST":
        base |= {"Content-Type": "application/json", "Content-Length": str(len(body))}
    given = list(headers.items()) if isinstance(headers, dict) else list(headers or [])
    if isinstance(headers, dict):
        base = {k: v for k, v in base.items() if k not in headers}
        given = [(k, v) for k, v in given if v is not None]
    lines = [f"{method} {path} HTTP/{version}", *(f"{k}: {v}" for k, v in [*base.items(), *given])]
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall("\r\n".join(lines).encode("latin-1") + b"\r\n\r\n" + body)
        data = b""
        while chunk := s.recv(1 << 16):
            data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    status_line, *fields = head.decode("latin-1").split("\r\n")
    out: dict[str, str] = {}
    for f in fields:
        name, _, value = f.partition(":")
        out[name.strip().lower()] = (out[name.strip().lower()] + ", " if name.strip().lower() in out else "") + \
            value.strip()
    return int(status_line.split()[1]), out, rest


def error_of(body: bytes) -> dict:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}                      # OpenAI's shape
    return err


def test_serve_hands_the_key_to_its_front_by_environment_and_every_route_but_health_needs_it(guarded):
    path, addr, port, proc = guarded
    status, headers, body = exchange(port, "GET", "/v1/models", {"Authorization": None})
    assert status == 401 and headers["www-authenticate"] == "Bearer"
    assert "Authorization: Bearer" in error_of(body)["message"] and KEY not in body.decode()
    for wrong in (f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", "Bearer", f"Basic {KEY}", f"Token {KEY}"):
        status, _, body = exchange(port, "GET", "/v1/models", {"Authorization": wrong})
        assert (status, error_of(body)["code"]) == (401, "invalid_api_key"), wrong
    assert exchange(port, "GET", "/v1/models")[0] == 200
    assert exchange(port, "GET", "/metrics", {"Authorization": None})[0] == 401
    status, _, body = exchange(port, "GET", "/metrics")
    assert status == 200 and 'colibri_openai:refused_total{status="401"}' in body.decode()    # refusals counted
    assert exchange(port, "GET", "/v1/nothing", {"Authorization": None})[0] == 401   # no route list for strangers
    status, _, body = exchange(port, "GET", "/health", {"Authorization": None})
    assert status == 200 and json.loads(body) == {"status": "ok"}                    # and no address in it
    url = f"http://127.0.0.1:{port}/v1"
    api = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=60)
    assert api.completions.create(**COMPLETION).usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
    fleet_procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    assert len(fleet_procs) >= 4 and not any(KEY in " ".join(argv_of(p)) for p in fleet_procs)   # never in argv


def test_models_and_model_info_name_the_model_only(guarded):
    path, addr, port, proc = guarded
    status, _, body = exchange(port, "GET", "/v1/models")
    text = body.decode()
    assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == ["chatty"]
    assert str(path.parent) not in text and "/" not in text                        # not even part of the path
    workers = [port_of(w) for w in workers_of(proc)]
    assert workers and not any(w.rsplit(":", 1)[1] in text for w in workers) and addr not in text
    info = Client(addr).model_info()
    assert (info.model_path, list(info.workers)) == ("chatty", [])
    status, _, body = exchange(port, "GET", "/v1/models/chatty")
    assert status == 200 and json.loads(body)["root"] == "chatty"


@pytest.mark.parametrize("host", ["evil.example", "evil.example:80", "127.0.0.1.nip.io", "[::2]:8000", "localhost@x",
                                  "a:b:c", "", "["])
def test_a_host_it_does_not_answer_to_is_421(guarded, host):
    *_, port, _ = guarded
    status, _, body = exchange(port, "POST", "/v1/completions", {"Host": host}, json.dumps(COMPLETION).encode())
    assert status == 421, body
    assert "--allowed-hosts" in error_of(body)["message"]
    status, _, body = exchange(port, "GET", "/health", {"Host": host})         # health too: a page learns nothing
    assert status == 421


def test_the_names_of_this_front_and_no_host_header_in_http_1_0_pass_and_two_host_headers_do_not(guarded):
    *_, port, _ = guarded
    for host in (f"localhost:{port}", "127.0.0.1", f"[::1]:{port}", "LOCALHOST."):
        assert exchange(port, "GET", "/v1/models", {"Host": host})[0] == 200, host
    assert exchange(port, "GET", "/v1/models", {"Host": None}, version="1.0")[0] == 200   # HTTP/1.0: none sent
    status, _, body = exchange(port, "GET", "/v1/models", {"Host": None})      # HTTP/1.1 without one: RFC 9112's 400
    assert status == 400 and "an HTTP/1.1 request needs a Host header" in error_of(body)["message"], body
    status, _, body = exchange(port, "GET", "/v1/models", [("Host", "localhost")])   # a second Host header
    assert status == 400 and "Host headers" in error_of(body)["message"]


@pytest.mark.parametrize(("kind", "ok"), [
    ("text/plain", False), (None, False), ("application/x-www-form-urlencoded", False), ("multipart/form-data", False),
    ("application/jsonx", False), ("application/json; charset=latin-1", False),
    ("application/json", True), ("application/json; charset=utf-8", True), ("Application/JSON;charset=\"UTF-8\"", True),
])
def test_post_bodies_must_be_declared_json(guarded, kind, ok):
    *_, port, _ = guarded
    status, _, body = exchange(port, "POST", "/v1/completions", {"Content-Type": kind},
                               json.dumps(COMPLETION).encode())
    if ok:
        assert status == 200, body
    else:
        assert status == 415 and "Content-Type: application/json" in error_of(body)["message"]


def test_a_second_content_type_header_is_refused(guarded):
    *_, port, _ = guarded          # the first alone was checked: 'application/json' then 'text/plain' was a 200
    status, _, body = exchange(port, "POST", "/v1/completions", [("Content-Type", "text/plain")],
                               json.dumps(COMPLETION).encode())
    assert status == 400 and "2 Content-Type headers; send one" in error_of(body)["message"], body


def test_no_cors_without_allowed_origins(guarded):
    *_, port, _ = guarded
    status, headers, _ = exchange(port, "GET", "/v1/models", {"Origin": PAGE})
    assert status == 200 and not any(h.startswith("access-control-") for h in headers)
    status, headers, body = exchange(port, "OPTIONS", "/v1/chat/completions",
                                     {"Origin": PAGE, "Access-Control-Request-Method": "POST",
                                      "Access-Control-Request-Headers": "authorization, content-type",
                                      "Authorization": None})
    assert status == 403 and not any(h.startswith("access-control-") for h in headers)
    assert "--allowed-origins" in error_of(body)["message"]


@contextmanager
def front(target: str, *flags: str):
    """`colibri openai` alone in front of `target`, with $COLIBRI_API_KEY; yields its port."""
    p = colibri_popen(["openai", "--target", target, "--port", "0", "--log-level", "WARNING", *flags],
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ, **{API_KEY_ENV: KEY}))
    try:
        line = p.stdout.readline()
        assert line.startswith("ready "), p.stderr.read()
        yield int(line.split()[1].rsplit(":", 1)[1])
    finally:
        p.terminate()
        assert p.wait(timeout=30) == 0


def test_allowed_origins_get_cors_headers_and_preflights_others_do_not(guarded):
    _, addr, *_ = guarded
    with front(addr, "--allowed-origins", f"{PAGE},http://localhost:3000") as port:
        preflight = {"Origin": PAGE, "Access-Control-Request-Method": "POST", "Authorization": None,
                     "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"}
        status, headers, _ = exchange(port, "OPTIONS", "/v1/chat/completions", preflight)
        assert status == 204 and headers["access-control-allow-origin"] == PAGE
        assert headers["access-control-allow-headers"] == "authorization, content-type, x-stainless-os"
        assert "POST" in headers["access-control-allow-methods"] and headers["vary"] == "origin"
        status, headers, _ = exchange(port, "OPTIONS", "/v1/models", {**preflight, "Origin": "https://other.example"})
        assert status == 403 and "access-control-allow-origin" not in headers
        status, headers, _ = exchange(port, "POST", "/v1/completions", {"Origin": "http://LOCALHOST:3000"},
                                      json.dumps(COMPLETION).encode())
        assert status == 200 and headers["access-control-allow-origin"] == "http://LOCALHOST:3000"
        status, headers, _ = exchange(port, "GET", "/v1/models", {"Origin": PAGE, "Authorization": None})
        assert status == 401 and headers["access-control-allow-origin"] == PAGE     # the page may read why
        status, headers, _ = exchange(port, "GET", "/v1/models", {"Origin": "https://other.example"})
        assert status == 200 and "access-control-allow-origin" not in headers
        assert not any(h.startswith("access-control-") for h in exchange(port, "GET", "/v1/models")[1])


def test_http10_streaming_is_refused_clearly_and_http10_without_streaming_is_answered(guarded):
    *_, port, _ = guarded
    stream = json.dumps({**COMPLETION, "stream": True}).encode()
    status, headers, body = exchange(port, "POST", "/v1/completions", {"Connection": None}, stream, version="1.0")
    assert status == 400 and "transfer-encoding" not in headers
    err = error_of(body)
    assert err["param"] == "stream" and "HTTP/1.1" in err["message"]
    assert headers["content-length"] == str(len(body))
    status, headers, body = exchange(port, "POST", "/v1/completions", {"Connection": None},
                                     json.dumps(COMPLETION).encode(), version="1.0")
    assert status == 200 and "transfer-encoding" not in headers and headers["content-length"] == str(len(body))
    assert json.loads(body)["usage"]["completion_tokens"] == 2
    status, headers, body = exchange(port, "POST", "/v1/completions", {}, stream)      # HTTP/1.1 streams
    assert status == 200 and headers["transfer-encoding"] == "chunked" and b"data: [DONE]" in body


@pytest.mark.parametrize("headers", [
    {"Host": "\xff\xfe"}, {"Host": "x" * 5000}, {"Host": "[::1]:99999999999"}, {"Authorization": "Bearer \xff\xfe"},
    {"Authorization": "Bearer " + "k" * 10_000}, {"Authorization": "\xff"}, {"Content-Type": "\xff;;;=="},
    {"Content-Type": "application/json; charset"}, {"Origin": "null"}, {"Origin": "\xff://"},
    {"Access-Control-Request-Method": "POST", "Origin": PAGE, "Authorization": None},
])
def test_bad_header_values_are_answered_and_never_crash_the_front(guarded, headers):
    *_, port, _ = guarded
    status, _, body = exchange(port, "POST", "/v1/completions", headers, json.dumps(COMPLETION).encode())
    assert 200 <= status < 500, (status, body)
    assert exchange(port, "GET", "/v1/models")[0] == 200                      # still serving


def test_a_head_over_max_header_bytes_is_431_and_counted_and_the_front_goes_on(guarded):
    """uvicorn's httptools protocol took a head of any size (nginx stops at 32 KiB, h11 at 16 KiB): 100 headers of 1
    KiB are 431 (OpenAI's shape, the connection closed), 40 of them pass, and the refusal is counted."""
    *_, port, _ = guarded
    many = [(f"X-Pad-{i}", "p" * 1024) for i in range(100)]
    status, headers, body = exchange(port, "GET", "/v1/models", many)
    assert status == 431 and headers["connection"] == "close", (status, body)
    err = error_of(body)
    assert err["code"] == "headers_too_large" and "--max-header-bytes" in err["message"]
    assert exchange(port, "GET", "/v1/models", many[:40])[0] == 200
    status, _, counted = exchange(port, "GET", "/metrics")
    assert status == 200 and 'colibri_openai:refused_total{status="431"}' in counted.decode()


def test_a_head_over_the_bound_behind_a_pipelined_request_is_answered_after_it_in_order(guarded):
    """Pipelined on one connection (one write): a request's answer first, then the 431 of the head behind it, and
    nothing after that is read (the 431 went out first, as the answer to the request before it)."""
    *_, port, _ = guarded
    auth = f"Host: 127.0.0.1:{port}\r\nAuthorization: Bearer {KEY}\r\n"
    pad = "".join(f"X-Pad-{i}: {'p' * 1024}\r\n" for i in range(100))
    wire = (f"GET /v1/models HTTP/1.1\r\n{auth}\r\n" f"GET /v1/models HTTP/1.1\r\n{auth}{pad}\r\n"
            f"GET /v1/models HTTP/1.1\r\n{auth}\r\n")
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(wire.encode())
        while chunk := s.recv(1 << 16):
            got += chunk
    statuses = [int(code) for code in re.findall(rb"HTTP/1\.1 (\d{3}) ", got)]
    assert statuses == [200, 431], got[:300]


def test_a_head_that_never_ends_is_refused_once_past_the_bound_not_held(guarded):
    """One header value sent on and on with no end of line: answered 431 once ~64 KiB have come, and closed (it was
    kept, growing, for as long as the client sent)."""
    *_, port, _ = guarded
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nX-Endless: ".encode())
        sent = 0
        try:
            while sent < 16 << 20:                   # 16 MiB at most: the front stops it long before
                s.sendall(b"e" * 65536)
                sent += 65536
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            while chunk := s.recv(1 << 16):
                got += chunk
        except ConnectionResetError:
            pass
    assert sent < 16 << 20, "the front read 16 MiB of one header"
    assert got.startswith(b"HTTP/1.1 431 "), got[:200]
    assert exchange(port, "GET", "/v1/models")[0] == 200


def test_what_the_http_parser_refuses_is_a_json_400_with_its_reason(guarded):
    """A bad Content-Length, or both Content-Length and chunked: uvicorn answered plain text that named nothing."""
    *_, port, _ = guarded
    for headers in ({"Content-Length": "-1"}, {"Content-Length": "abc"},
                    [("Transfer-Encoding", "chunked"), ("Content-Length", "2")]):
        status, reply, body = exchange(port, "POST", "/v1/completions", headers, b"{}")
        assert status == 400 and reply["content-type"] == "application/json", (status, body)
        err = error_of(body)
        assert err["code"] == "invalid_http" and err["message"].startswith("the request is not valid HTTP/1.1 ("), err
    assert exchange(port, "GET", "/v1/models")[0] == 200


def test_a_trailing_slash_is_a_404_that_names_the_route_and_a_compressed_body_is_415(guarded):
    *_, port, _ = guarded
    status, _, body = exchange(port, "POST", "/v1/completions/", body=json.dumps(COMPLETION).encode())
    assert status == 404, (status, body)                                      # it was a bare 307
    assert "send /v1/completions, without the trailing slash" in error_of(body)["message"]
    packed = gzip.compress(json.dumps(COMPLETION).encode())
    for coding, sent in (("gzip", packed), ("br", json.dumps(COMPLETION).encode())):
        status, _, body = exchange(port, "POST", "/v1/completions", {"Content-Encoding": coding}, sent)
        assert status == 415 and error_of(body)["code"] == "unsupported_content_encoding", (status, body)
    status, _, body = exchange(port, "POST", "/v1/completions", {"Content-Encoding": "identity"},
                               json.dumps(COMPLETION).encode())
    assert status == 200, (status, body)


def test_a_connection_that_stops_sending_is_closed_after_the_read_timeout(guarded):
    """`colibri openai --request-read-timeout 2`: a connection that sends nothing is closed; one whose head or body
    stopped coming is answered 408 (OpenAI's shape) and closed; each is counted once (the body's by the app). A
    request sent in pieces 0.2 s apart is served (the clock restarts with each read). uvicorn held all of these
    open for good. (tests/test_openai_connection_rules.py has the rules' other cases on a small app.)"""
    _, addr, *_ = guarded
    with front(addr, "--request-read-timeout", "2") as port:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {KEY}\r\n"
        full = json.dumps(COMPLETION).encode()
        waited, got = talk(port)
        assert got == b"" and waited < 15
        for partial in ((head + "Content-Type: appl").encode(),
                        (head + f"Content-Type: application/json\r\nContent-Length: {len(full)}\r\n\r\n").encode()
                        + full[:5]):
            waited, got = talk(port, partial)
            assert got.startswith(b"HTTP/1.1 408 ") and waited < 15, got[:200]
            assert error_of(got.partition(b"\r\n\r\n")[2])["code"] == "request_timeout"
        whole = (head + f"Content-Type: application/json\r\nContent-Length: {len(full)}\r\nConnection: close"
                        f"\r\n\r\n").encode() + full
        _, got = talk(port, *(whole[i:i + 40] for i in range(0, len(whole), 40)), pause=0.2)
        assert got.startswith(b"HTTP/1.1 200 "), got[:200]
        deadline = time.monotonic() + 10                  # the body's 408 is counted by the app, after the close
        while 'refused_total{status="408"} 3.0' not in (counted := exchange(port, "GET", "/metrics")[2].decode()) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert 'colibri_openai:refused_total{status="408"} 3.0' in counted, counted[-800:]


def test_max_header_bytes_below_a_kib_is_refused():
    with pytest.raises(ValueError, match="--max-header-bytes must be at least 1024"):
        OpenAIOptions(target="r:1", max_header_bytes=512)


def test_a_request_read_timeout_of_zero_or_less_is_refused():
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="--request-read-timeout must be positive"):
            OpenAIOptions(target="r:1", request_read_timeout=bad)

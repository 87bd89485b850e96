"""Streaming overhead of the HTTP frameworks the OpenAI-compatible front could use: Starlette on uvicorn
(StreamingResponse over an async generator, uvicorn's h11 and httptools parsers) against aiohttp.web
(StreamResponse, one write per event).

The workload is shaped like token streaming: each request is a server-sent-events stream of N small JSON
events (an OpenAI chat.completion.chunk of about 250 bytes, built with json.dumps per event as the front
would), and the server's generator awaits asyncio.sleep(0) between events to model a token arriving from the
router's gRPC stream (and, in one more row, asyncio.sleep(0.02): 32 streams at 50 tokens/s each). Every
server runs in its own subprocess on loopback, pinned to one core with the client on the other, so the
server's CPU (read with psutil on its pid) is its own. One client drives every server: a bare
asyncio.Protocol HTTP/1.1 client on keep-alive connections that counts events by their blank line (it parses
no JSON, so it stays cheap); httpx checks each server's stream once for well-formed events. For each server
and for 1 and for 32 concurrent streams it reports events/s in total, server CPU per event (and that less
the generator's own cost, measured in-process without HTTP), and the time to first event (p50 and p99).

It also tests client disconnects: a client reads 10 events of a long stream and closes its socket; the
server's generator records when it sees CancelledError or GeneratorExit (CLOCK_MONOTONIC is shared by the
processes), for a fast producer (sleep(0)) and a paced one (a token every 50 ms).

The frameworks are imported only inside the functions that need them, so nothing else needs them
installed. Run it from a scratch virtualenv that has them, from the repository root:

    python3 -m venv /tmp/httpbench
    /tmp/httpbench/bin/pip install starlette==1.10.0 uvicorn==0.54.0 httptools==0.9.0 aiohttp==3.14.5 \\
        httpx==0.28.1 psutil==7.2.2 packaging==26.4
    /tmp/httpbench/bin/python benchmarks/http_frameworks.py [--runs 3] [--events 200]

It prints a markdown table and writes it to benchmarks/results/http_frameworks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
HOST = "127.0.0.1"
SERVERS = {
    "starlette-h11": "Starlette 1.x StreamingResponse on uvicorn, --http h11 --loop asyncio",
    "starlette-httptools": "Starlette 1.x StreamingResponse on uvicorn, --http httptools --loop asyncio",
    "aiohttp": "aiohttp.web StreamResponse, write per event, asyncio loop, handler_cancellation=False (default)",
    "aiohttp-cancel": "aiohttp.web as above with handler_cancellation=True",
}
PACKAGES = ["starlette", "uvicorn", "httptools", "aiohttp", "httpx", "psutil"]
REPORTS: dict[str, dict[str, object]] = {}  # in a server process: what each tagged generator saw, by tag


# --------------------------------------------------------------------------------------------------- server


def chunk_event(i: int) -> bytes:
    """One OpenAI chat.completion.chunk as an SSE event, about 250 bytes."""
    obj = {
        "id": "chatcmpl-7f3a9c2e4b1d4e8f9a0b1c2d3e4f5a6b",
        "object": "chat.completion.chunk",
        "created": 1767225600,
        "model": "colibri-moe-8x1b-instruct",
        "system_fingerprint": "fp_colibri_0001",
        "choices": [{"index": 0, "delta": {"content": f" tok{i}"}, "logprobs": None, "finish_reason": None}],
    }
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def events(n: int, delay_s: float, tag: str) -> AsyncIterator[bytes]:
    """The stream body: n chunk events then [DONE], awaiting between events as a gRPC token stream would.
    A tagged stream records how it ended (and when, on CLOCK_MONOTONIC) for the disconnect test."""
    sent, outcome = 0, "completed"
    try:
        for i in range(n):
            yield chunk_event(i)
            sent += 1
            await asyncio.sleep(delay_s)
        yield b"data: [DONE]\n\n"
    except asyncio.CancelledError:
        outcome = "CancelledError"
        raise
    except GeneratorExit:
        outcome = "GeneratorExit"
        raise
    except BaseException as e:
        outcome = type(e).__name__
        raise
    finally:
        if tag:
            REPORTS[tag] = {"outcome": outcome, "t": time.monotonic(), "sent": sent}


def query(qs: dict[str, str]) -> tuple[int, float, str]:
    return int(qs.get("n", "200")), float(qs.get("delay_ms", "0")) / 1000, qs.get("tag", "")


def serve_starlette(port: int, http: str) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    async def stream(request: Request) -> StreamingResponse:
        n, delay_s, tag = query(dict(request.query_params))
        return StreamingResponse(events(n, delay_s, tag), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def report(request: Request) -> JSONResponse:
        return JSONResponse(REPORTS.get(request.query_params["tag"], {}))

    async def health(request: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/stream", stream), Route("/report", report), Route("/health", health)])
    uvicorn.run(app, host=HOST, port=port, http=http, loop="asyncio", lifespan="off", access_log=False,
                log_level="warning")


def serve_aiohttp(port: int, handler_cancellation: bool) -> None:
    from aiohttp import web

    async def stream(request: web.Request) -> web.StreamResponse:
        n, delay_s, tag = query(dict(request.query))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        try:
            async with contextlib.aclosing(events(n, delay_s, tag)) as gen:
                async for ev in gen:
                    await resp.write(ev)
        except BaseException as e:
            if tag:
                REPORTS.setdefault(tag, {})["handler_saw"] = type(e).__name__
            raise
        await resp.write_eof()
        return resp

    async def report(request: web.Request) -> web.Response:
        return web.json_response(REPORTS.get(request.query["tag"], {}))

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/stream", stream)
    app.router.add_get("/report", report)
    app.router.add_get("/health", health)
    web.run_app(app, host=HOST, port=port, access_log=None, print=None, handler_cancellation=handler_cancellation)


def serve(kind: str, port: int) -> None:
    if kind == "starlette-h11":
        serve_starlette(port, "h11")
    elif kind == "starlette-httptools":
        serve_starlette(port, "httptools")
    elif kind == "aiohttp":
        serve_aiohttp(port, False)
    elif kind == "aiohttp-cancel":
        serve_aiohttp(port, True)
    else:
        raise SystemExit(f"unknown server {kind}")


# --------------------------------------------------------------------------------------------------- client


class StreamClient(asyncio.Protocol):
    """A keep-alive HTTP/1.1 connection that reads one chunked SSE response at a time, counting events by
    their terminating blank line (chunk framing and headers use CRLF, so they never contain one). A bare
    protocol, not StreamReader, so the client's cost per event stays well below the server's."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future[None] | None = None
        self.count, self.stop_after, self.t0, self.ttfe = 0, 0, 0.0, 0.0
        self.last, self.tail = b"", b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        c = (self.last + data).count(b"\n\n")
        if c and not self.count:
            self.ttfe = time.perf_counter() - self.t0
        self.count += c
        self.last, self.tail = data[-1:], (self.tail + data)[-16:]
        if self.done is not None and not self.done.done() and (
                (self.stop_after and self.count >= self.stop_after) or self.tail.endswith(b"\r\n0\r\n\r\n")):
            self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError("server closed the connection mid-stream"))

    async def get(self, path: str, stop_after: int = 0) -> tuple[float, float, int]:
        """One GET, read to the end of the body (or to stop_after events): (seconds to first event,
        seconds in all, events)."""
        assert self.transport is not None
        self.done = asyncio.get_running_loop().create_future()
        self.count, self.stop_after, self.last, self.tail = 0, stop_after, b"", b""
        self.t0 = time.perf_counter()
        self.transport.write(f"GET {path} HTTP/1.1\r\nHost: {HOST}\r\nAccept: text/event-stream\r\n\r\n".encode())
        await self.done
        return self.ttfe, time.perf_counter() - self.t0, self.count

    def close(self) -> None:
        assert self.transport is not None
        self.transport.close()


async def connect(port: int) -> StreamClient:
    _, proto = await asyncio.get_running_loop().create_connection(StreamClient, HOST, port)
    return proto


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


@dataclass
class Load:
    streams: int
    events: int
    wall_s: float
    server_cpu_s: float
    client_cpu_s: float
    ttfe_s: list[float]
    total_s: list[float]


async def load(port: int, streams: int, per_stream: int, n: int,
               delay_ms: float = 0) -> tuple[int, float, list[float], list[float]]:
    """streams connections, each running per_stream requests one after another."""
    ttfe: list[float] = []
    total: list[float] = []
    counted = 0

    async def worker() -> None:
        nonlocal counted
        client = await connect(port)
        try:
            for _ in range(per_stream):
                t, d, c = await client.get(f"/stream?n={n}&delay_ms={delay_ms}")
                if c != n + 1:
                    raise RuntimeError(f"expected {n + 1} events, counted {c}")
                ttfe.append(t)
                total.append(d)
                counted += c
        finally:
            client.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(streams)))
    return counted, time.perf_counter() - t0, ttfe, total


def measure(pid: int, port: int, streams: int, per_stream: int, n: int, delay_ms: float = 0) -> Load:
    import psutil

    proc = psutil.Process(pid)
    asyncio.run(load(port, min(streams, 4), 2, n))  # warm up
    c0, k0 = proc.cpu_times(), time.process_time()
    counted, wall, ttfe, total = asyncio.run(load(port, streams, per_stream, n, delay_ms))
    c1, k1 = proc.cpu_times(), time.process_time()
    return Load(streams, counted, wall, (c1.user + c1.system) - (c0.user + c0.system), k1 - k0, ttfe, total)


def check_with_httpx(port: int, n: int) -> str:
    """Parse one stream as an SSE client would: every data line is JSON, the last is [DONE]."""
    import httpx

    datas: list[str] = []
    with httpx.stream("GET", f"http://{HOST}:{port}/stream?n={n}", timeout=30) as r:
        ctype = r.headers["content-type"]
        for line in r.iter_lines():
            if line.startswith("data: "):
                datas.append(line[6:])
    assert datas[-1] == "[DONE]" and len(datas) == n + 1, (len(datas), datas[-1:])
    for d in datas[:-1]:
        json.loads(d)
    return ctype


async def disconnect_once(port: int, delay_ms: float, tag: str) -> dict[str, object]:
    client = await connect(port)
    await client.get(f"/stream?n=100000&delay_ms={delay_ms}&tag={tag}", stop_after=10)
    t_close = time.monotonic()
    client.close()
    await asyncio.sleep(max(0.3, 4 * delay_ms / 1000))
    reader, writer = await asyncio.open_connection(HOST, port)
    writer.write(f"GET /report?tag={tag} HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode())
    body = (await reader.read()).split(b"\r\n\r\n", 1)[1]
    writer.close()
    rep = json.loads(body) if body.strip() else {}
    rep["latency_ms"] = (float(rep["t"]) - t_close) * 1000 if "t" in rep else None
    return rep


# --------------------------------------------------------------------------------------------------- driver


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def wait_ready(port: int, proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with socket.create_connection((HOST, port), timeout=0.5) as s:
                s.sendall(f"GET /health HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode())
                if s.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError("server did not come up")


@contextlib.contextmanager
def server(kind: str, core: int | None, log: Path) -> Iterator[tuple[int, int]]:
    port = free_port()
    cmd = [sys.executable, __file__, "--serve", kind, "--port", str(port)]
    with log.open("ab") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
    try:
        if core is not None:
            os.sched_setaffinity(proc.pid, {core})
        wait_ready(port, proc)
        yield proc.pid, port
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def generator_cost_us(n: int, reps: int = 50) -> float:
    """CPU microseconds per event of the generator alone (json.dumps and the sleep(0)), with no HTTP."""

    async def drain() -> int:
        count = 0
        for _ in range(reps):
            async for _ev in events(n, 0.0, ""):
                count += 1
        return count

    asyncio.run(drain())
    t0 = time.process_time()
    count = asyncio.run(drain())
    return (time.process_time() - t0) / count * 1e6


def cpu_header(cores: int) -> str:
    model, flags = "unknown", ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, val = line.partition(":")
            if key.strip() == "model name" and model == "unknown":
                model = val.strip()
            elif key.strip() == "flags" and not flags:
                flags = val.strip()
    return (f"CPU: {model}, {cores} cores usable (client pinned to one, server to another), "
            f"Python {platform.python_version()} ({platform.python_implementation()})\n\nCPU flags: `{flags}`")


def closure(root: str) -> list[str]:
    """root and what it pulls in (pinned as installed), skipping extras and markers that do not apply."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # fall back to: a requirement that is installed applies
        Requirement = None  # type: ignore[assignment,misc]
    seen: dict[str, str] = {}
    todo = [root]
    while todo:
        name = todo.pop()
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        key = dist.metadata["Name"]
        if key.lower() in (k.lower() for k in seen):
            continue
        seen[key] = dist.version
        for spec in dist.requires or []:
            if "extra ==" in spec:
                continue
            if Requirement is not None:
                req = Requirement(spec)
                if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                    continue
                todo.append(req.name)
            else:
                todo.append(spec.split(";")[0].split("[")[0].split("<")[0].split(">")[0].split("=")[0].strip())
    return [f"{k}=={v}" for k, v in sorted(seen.items(), key=lambda kv: kv[0].lower())]


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--servers", default=",".join(k for k in SERVERS if k != "aiohttp-cancel"))
    ap.add_argument("--disconnect-servers", default=",".join(SERVERS))
    ap.add_argument("--events", type=int, default=200, help="events per stream")
    ap.add_argument("--streams", default="1,32,32@20", help="concurrent streams; S@D: S streams paced D ms a token")
    ap.add_argument("--events-per-level", type=int, default=16000, help="events measured at each concurrency")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "http_frameworks.md"))
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.port)
        return

    cores = sorted(os.sched_getaffinity(0))
    client_core, server_core = (cores[0], cores[1]) if len(cores) >= 2 else (None, None)
    if client_core is not None:
        os.sched_setaffinity(0, {client_core})
    log = Path(os.environ.get("TMPDIR", "/tmp")) / "http_frameworks_servers.log"
    n = args.events
    gen_us = generator_cost_us(n)
    print(f"generator alone: {gen_us:.1f} CPU us/event", flush=True)

    headers = ["Server", "Streams", "Run", "Events/s", "Server CPU us/event", "less generator", "Server CPU %",
               "TTFE p50 ms", "TTFE p99 ms", "Stream p50 ms", "Stream p99 ms", "Client CPU %"]
    rows: list[list[str]] = []
    ctypes: dict[str, str] = {}
    for run in range(1, args.runs + 1):  # runs outermost, so the VM's drifts in speed spread over every server
        for kind in args.servers.split(","):
            with server(kind, server_core, log) as (pid, port):
                ctypes[kind] = check_with_httpx(port, n)
                for level in args.streams.split(","):
                    streams, _, paced = level.partition("@")
                    delay_ms = float(paced or 0)
                    per_stream = 1 if delay_ms else max(2, args.events_per_level // (n * int(streams)))
                    r = measure(pid, port, int(streams), per_stream, n, delay_ms)
                    us = r.server_cpu_s / r.events * 1e6
                    label = f"{streams}, a token / {paced} ms" if paced else streams
                    row = [kind, label, str(run), f"{r.events / r.wall_s:,.0f}", f"{us:.1f}",
                           f"{us - gen_us:.1f}", f"{100 * r.server_cpu_s / r.wall_s:.0f}",
                           f"{1e3 * statistics.median(r.ttfe_s):.2f}", f"{1e3 * pct(r.ttfe_s, 99):.2f}",
                           f"{1e3 * statistics.median(r.total_s):.1f}", f"{1e3 * pct(r.total_s, 99):.1f}",
                           f"{100 * r.client_cpu_s / r.wall_s:.0f}"]
                    rows.append(row)
                    print(" | ".join(row), flush=True)

    dheaders = ["Server", "Producer", "Latency to generator end, ms (3 trials)", "Generator saw",
                "Handler saw", "Events generated"]
    drows: list[list[str]] = []
    for kind in args.disconnect_servers.split(","):
        with server(kind, server_core, log) as (_pid, port):
            for delay_ms, label in ((0, "sleep(0)"), (50, "token / 50 ms")):
                reps = [asyncio.run(disconnect_once(port, delay_ms, f"{kind}-{delay_ms}-{i}")) for i in range(3)]
                lat = ", ".join("never" if r["latency_ms"] is None else f"{r['latency_ms']:.1f}" for r in reps)
                drow = [kind, label, lat, "/".join(sorted({str(r.get("outcome", "still running")) for r in reps})),
                        "/".join(sorted({str(r.get("handler_saw", "-")) for r in reps})),
                        ", ".join(str(r.get("sent", "?")) for r in reps)]
                drows.append(drow)
                print(" | ".join(drow), flush=True)

    pins = {k: closure(k) for k in ("starlette", "uvicorn", "aiohttp", "httptools")}
    md = "\n".join([
        "# HTTP framework streaming overhead (SSE token streams)",
        "",
        cpu_header(len(cores)),
        "",
        "Packages: " + ", ".join(f"{p}=={version(p)}" for p in PACKAGES) + ".",
        "",
        "What each framework pulls in (installed versions, markers for this Python):",
        "",
        *(f"- {k}: {', '.join(v)}" for k, v in pins.items()),
        "",
        "Servers: " + "; ".join(f"`{k}`: {v}" for k, v in SERVERS.items()) + ". Access logs off; uvicorn "
        "lifespan off. Each server is a subprocess pinned to one core, the client to the other.",
        "",
        f"Workload: each request streams {n} chat.completion.chunk events of {len(chunk_event(0))} bytes and "
        "`data: [DONE]`, over chunked HTTP/1.1 on keep-alive loopback connections; the generator awaits "
        f"asyncio.sleep(0) between events. About {args.events_per_level} events are measured per row after "
        "a warm-up. Client: a bare asyncio.Protocol HTTP/1.1 client (the same for every server) that counts "
        "events by their blank line; httpx 0.28 parsed one stream per server as a check (content-type: "
        + ", ".join(f"{k}: `{v}`" for k, v in ctypes.items()) + ").",
        "",
        f"The generator alone (json.dumps per event and the sleep(0), no HTTP) costs {gen_us:.1f} CPU us per "
        "event; 'less generator' is the server's CPU per event minus that, i.e. the framework's share. "
        "TTFE is the time from writing the request to reading the first event; Stream is the whole stream. "
        "Rows '32, a token / 20 ms' pace every stream at 50 tokens/s (sleep(0.02) in place of sleep(0)), all "
        "32 started at once, one stream each: a serving-like load where the server is mostly idle, so its CPU "
        "per event there includes the timer and wake-up costs of a sparse stream.",
        "",
        table(headers, rows),
        "",
        "## Client disconnect after 10 events",
        "",
        "The client reads 10 events of a 100000-event stream and closes its socket; latency runs from the "
        "close to the server's generator ending (both on CLOCK_MONOTONIC). 'Events generated' counts the "
        "events the generator yielded before it ended.",
        "",
        table(dheaders, drows),
        "",
    ])
    print()
    print(md)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(md)


if __name__ == "__main__":
    main()

"""`colibri serve`: the whole fleet on one machine — N expert workers and a router as child processes.

Each child is a visible process named by its role (`colibri expert --shard I/N …`, `colibri router …`),
gets an explicit thread count, and dies with the launcher (PR_SET_PDEATHSIG), so no orphans remain. On CPUs
the children are forked from the launcher once it has imported the services (`colibri.fork`): one import
of torch for the fleet instead of one per child. With GPUs each child is a fresh `colibri` process.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TypeVar

from colibri.cores import split_threads
from colibri.fork import FRONT_MODULES, SERVICE_MODULES, Entry, ForkedChild, die_with_parent, fork_command, preload
from colibri.openai_api.options import OpenAIOptions
from colibri.openai_api.policy import API_KEY_ENV
from colibri_common.config import ModelConfig
from colibri_common.errors import ConfigError
from colibri_common.file_watch import EXIT_RESTART, files_settled
from colibri_common.fleet_token import ENV as FLEET_ENV
from colibri_common.fleet_token import fleet_token, new_token
from colibri_common.options import option, shared_fields, to_argv
from expert_service.options import ExpertCacheOptions, ExpertOptions
from router_service.api.options import RouterOptions

log = logging.getLogger("colibri.serve")
SPAWNS = ("auto", "fork", "exec")
Child = subprocess.Popen | ForkedChild
T = TypeVar("T")


def colibri_command() -> list[str]:
    exe = Path(sys.executable).parent / "colibri"
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "colibri.cli"]


def exit_reason(code: int | None) -> str:
    """What a child's exit code says, for the log: a signal's name and its usual cause."""
    if code is None or code >= 0:
        return " (its files changed under it: it maps them afresh)" if code == EXIT_RESTART else ""
    try:
        name = signal.Signals(-code).name
    except ValueError:
        return ""
    why = {"SIGKILL": "killed: the kernel's OOM killer, or someone's kill -9",
           "SIGBUS": "a read through a mapped file whose pages were gone: a checkpoint file truncated or replaced "
                     "while served",
           "SIGSEGV": "a crash (please report it with the log above)"}.get(name, "")
    return f" ({name}{': ' + why if why else ''})"


def free_ports(n: int) -> list[int]:
    """n distinct ports free on loopback now (all held open while choosing, so none repeats)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass(frozen=True)
class ServeOptions:
    """`colibri serve`: the router's options (its worker addresses come from the workers it starts) + N."""

    # serve starts the workers itself (--workers N), so the router's ways of finding them are not its flags, and
    # its --replicas is the router's --expert-replicas
    EXCLUDED = ("router.workers", "router.follow_workers", "router.follow_interval", "router.expert_replicas")
    HELPS = {"router.threads": "cores to split between the router and the workers (0 = all cores)",
             "router.metrics_port": "serve the router's Prometheus metrics on this port P, and worker i's on "
                                    "P + 1 + i (default: off; 0 = any free ports)"}

    router: RouterOptions = RouterOptions()
    workers: int = option(2, "number of expert workers (shards) to start")
    replicas: int = option(1, "every expert on this many distinct workers: with 2, a dead worker's tokens go "
                              "to the others and no stream notices")
    tls_self_signed: bool = option(False, "make a throw-away CA and certificate (in $COLIBRI_CACHE_DIR/tls-PID or "
                                          "a temp dir; logged) and serve with mutual TLS between router and "
                                          "workers and TLS to clients")
    gpus: tuple[int, ...] = option((), "GPUs to place the fleet on: the router on the first, worker i on GPU "
                                       "i mod the count (each child gets --device cuda:N)", metavar="N[,N...]")
    cache: ExpertCacheOptions = ExpertCacheOptions()
    openai_port: int | None = option(None, "also start the OpenAI-compatible HTTP front (`colibri openai`) on "
                                           "this port of the router's host (0 = any free port)")
    served_model_name: str = option("", "with --openai-port: the model's name in the HTTP API (default: the "
                                        "checkpoint directory's name)")
    allowed_hosts: tuple[str, ...] = option((), "with --openai-port: the Host names the front answers (a Service, "
                                                "an ingress, a proxy name), in place of its defaults localhost, "
                                                "127.0.0.1 and [::1]: list those too to keep them; '*' = any",
                                            metavar="H[,H...]")
    allowed_origins: tuple[str, ...] = option((), "with --openai-port: web origins whose pages may call the front "
                                                  "(CORS); default none", metavar="O[,O...]")
    generation_config: str = option("auto", "with --openai-port: 'auto' gives requests that leave sampling "
                                            "fields out the checkpoint's generation_config.json values (as "
                                            "vLLM); 'vllm': OpenAI's defaults", choices=("auto", "vllm"))
    spawn: str = option("auto", "how the children start: 'fork' them from serve once it has imported torch and "
                                "the services (one import for the fleet, pages shared), or 'exec' a fresh "
                                "`colibri` for each; 'auto' forks on CPUs and execs with GPUs (CUDA cannot "
                                "cross a fork)", choices=SPAWNS)

    def __post_init__(self) -> None:
        if self.openai_port is not None and not 0 <= self.openai_port <= 65535:
            raise ValueError(f"--openai-port must be in [0, 65535], got {self.openai_port}")
        if self.workers <= 0:
            raise ValueError(f"--workers must be positive, got {self.workers}")
        if not 1 <= self.replicas <= self.workers:
            raise ValueError(f"--replicas {self.replicas}: need 1 <= R <= --workers ({self.workers})")
        if self.gpus and self.router.device != "cpu":
            raise ValueError("give --gpus (one GPU per child) or --device (all on one), not both")
        if any(g < 0 for g in self.gpus):
            raise ValueError(f"--gpus takes GPU indices >= 0, got {','.join(map(str, self.gpus))}")
        if self.gpus and (self.router.quantize or self.router.quantize_dense):
            raise ValueError("--quantize / --quantize-dense are the CPU path; on GPUs serve bfloat16")
        if self.gpus and self.router.batch_invariant:
            raise ValueError("--batch-invariant runs on CPUs (one-row kernels); on GPUs the Triton kernels' tiles "
                             "depend on the batch: serve without it")
        if self.spawn not in SPAWNS:
            raise ValueError(f"--spawn must be one of {', '.join(SPAWNS)}, got {self.spawn!r}")
        if self.spawn == "fork" and self.on_gpus:
            raise ValueError("--spawn fork is for CPU fleets: a CUDA context cannot cross a fork (use exec)")

    @property
    def on_gpus(self) -> bool:
        return bool(self.gpus) or self.router.device != "cpu"

    @property
    def forks(self) -> bool:
        return self.spawn == "fork" or (self.spawn == "auto" and not self.on_gpus)

    def device(self, child: int | None) -> str:
        """The device of worker `child`, or of the router (None)."""
        if not self.gpus:
            return self.router.device
        return f"cuda:{self.gpus[0 if child is None else child % len(self.gpus)]}"

    def expert(self, shard: int, threads: int, port: int = 0, sockets: Path | None = None) -> ExpertOptions:
        """Worker `shard`'s options: the service options it shares with the router, on loopback; with `sockets`
        (a directory only this user enters) its same-host socket there."""
        common = dict(shared_fields(self.router), host="127.0.0.1", port=port, threads=threads,
                      device=self.device(shard))
        mport = self.router.metrics_port                 # the router's port P; worker i gets P + 1 + i
        sched = self.router.sched
        return ExpertOptions(**common, shard=f"{shard}/{self.workers}", replicas=self.replicas, cache=self.cache,
                             max_step_tokens=max(sched.max_num_tokens, sched.max_batch_size),
                             metrics_port=None if mport is None else (mport and mport + 1 + shard),
                             local_socket="" if sockets is None else str(sockets / f"worker-{shard}.sock"))

    def router_options(self, workers: tuple[str, ...], threads: int) -> RouterOptions:
        return replace(self.router, workers=workers, threads=threads, device=self.device(None),
                       expert_replicas=self.replicas)     # a resize keeps the replicas serve was asked for

    def front(self, router: str) -> OpenAIOptions:
        """The HTTP front's options: on the router's host, a client of the router (its CA when TLS)."""
        assert self.openai_port is not None
        r = self.router
        return OpenAIOptions(target=router, host=r.host, port=self.openai_port,
                             served_model_name=self.served_model_name or Path(r.model).resolve().name,
                             tls_ca=r.tls_ca if r.tls_cert else None,
                             tls_cert=r.tls_cert if r.tls_client_auth else None,
                             tls_key=r.tls_key if r.tls_client_auth else None, log_level=r.log_level,
                             grace_period=r.grace_period, allowed_hosts=self.allowed_hosts,
                             allowed_origins=self.allowed_origins, generation_config=self.generation_config)


def child_argv(command: str, opts: RouterOptions | ExpertOptions | OpenAIOptions) -> list[str]:
    """The one way `serve` hands options to a child: the flags that rebuild `opts` there."""
    return [command, *to_argv(opts)]


class Fleet:
    def __init__(self, forks: bool = False, entry: Entry | None = None) -> None:
        self.children: list[Child] = []
        self.names: dict[int, str] = {}           # pid -> what it runs, for the log
        self.stopping = threading.Event()
        self.forks = forks
        self.entry = entry                  # what a forked child runs: colibri.cli.main, handed in by the CLI
        self.plane_env: dict[str, str] = {}  # the worker plane's secrets: for the router and the workers only
        # SimpleQueue: its put is reentrant, so a signal handler on the main thread may wake `serve_calls`
        self._calls: queue.SimpleQueue[tuple[Callable[[], object], Future]] = queue.SimpleQueue()

    def spawn(self, command: str, opts: RouterOptions | ExpertOptions | OpenAIOptions) -> Child:
        # PASSIVE: a process waiting on another (router on workers, workers on the router) must not keep
        # spinning OpenMP threads on the shared cores (measured: router step 109 -> 80 ms on 2 cores).
        threads = opts.threads if isinstance(opts, (RouterOptions, ExpertOptions)) else 1   # the front: one
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        if command in ("router", "expert"):        # each secret to the children that use it, no further
            env.update(self.plane_env)
            env.pop(API_KEY_ENV, None)
        else:
            env.pop(FLEET_ENV, None)
        argv = child_argv(command, opts)
        # Its own process group: a Ctrl-C in the terminal reaches serve alone, which stops the children in
        # order (the router drains first, the workers after it).
        cmd = [*colibri_command(), *argv]

        def start() -> Child:                       # on the main thread, so `stop` never misses a new child
            if self.stopping.is_set():
                raise RuntimeError("the fleet is stopping")
            if self.forks:                          # the other children's pipes are none of its business
                others = tuple(c.stdout for c in self.children if c.stdout is not None and not c.stdout.closed)
                assert self.entry is not None, "a forking fleet needs the CLI's entry point"
                p: Child = fork_command(argv, env, self.entry, new_group=True, close=others)
            else:
                p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env,
                                     preexec_fn=die_with_parent, process_group=0)
            self.children.append(p)
            self.names[p.pid] = f"colibri {command} (pid {p.pid})"
            return p

        p = self.on_main(start)
        log.info("%s pid %d: colibri %s", "forked" if self.forks else "started", p.pid, " ".join(argv))
        return p

    def on_main(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the main thread, the one thread a child may be forked from (a fork copies only the
        calling thread, and PR_SET_PDEATHSIG follows the thread that forked): directly when called there,
        else through `serve_calls`, which the main thread runs while it supervises."""
        if threading.current_thread() is threading.main_thread():
            return fn()
        fut: Future = Future()
        self._calls.put((fn, fut))
        return fut.result()

    def wake(self) -> None:
        """Wake `serve_calls` now (it sees its `until` set at once, not at its next poll)."""
        self._calls.put((lambda: None, Future()))

    def serve_calls(self, until: threading.Event, poll_s: float = 0.05) -> None:
        """The main thread's loop while the fleet runs: the other threads' calls, until `until` is set (call
        `wake` after setting it)."""
        while not until.is_set():
            try:
                fn, fut = self._calls.get(timeout=poll_s)
            except queue.Empty:
                continue
            try:
                fut.set_result(fn())
            except Exception as exc:  # noqa: BLE001  (it is the caller's to handle)
                fut.set_exception(exc)
        while not self._calls.empty():              # a caller waiting at the end gets an answer, not a hang
            self._calls.get_nowait()[1].set_exception(RuntimeError("the fleet is stopping"))

    @staticmethod
    def wait_ready(p: Child, what: str) -> str:
        """Read the child's stdout until `ready HOST:PORT`; error if it exits first."""
        assert p.stdout is not None
        for line in p.stdout:
            if line.startswith("ready "):
                return line.split()[1]
        code = p.wait()
        raise RuntimeError(f"{what} exited with code {code} before it was ready (its log is above)")

    def signal_all(self, signum: int) -> None:
        """`signum` to every child still running (a second signal to serve: the router's drain stops at once)."""
        for p in list(self.children):
            if p.poll() is None:
                p.send_signal(signum)

    def stop(self, first: tuple[Child, ...] = (), first_timeout: float = 15.0,
             timeout: float = 15.0) -> None:
        """SIGTERM to `first` (the router, which drains) and wait for them; then the others; SIGKILL whatever
        outlives its timeout."""
        self.stopping.set()
        rest = [p for p in self.children if p not in first]
        for group, wait_s in ((list(first), first_timeout), (rest, timeout)):
            for p in group:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in group:
                try:
                    p.wait(timeout=wait_s)
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop within %.0fs: killing it", self.names.get(p.pid, f"pid {p.pid}"),
                                wait_s)
                    p.kill()
                    p.wait()


def serve(opts: ServeOptions, entry: Entry) -> int:
    """Run the fleet until a signal (or a fatal failure); its workers' same-host sockets live in a directory of
    their own (mode 0700), removed when the fleet stops. `entry` is what forked children run (colibri.cli.main)."""
    sockets = Path(tempfile.mkdtemp(prefix="colibri-fleet-"))
    on_exit: list[Callable[[], None]] = []
    try:
        return _serve(opts, sockets, entry, on_exit)
    finally:
        shutil.rmtree(sockets, ignore_errors=True)
        for undo in on_exit:                    # the throw-away TLS files
            undo()


def _serve(opts: ServeOptions, sockets: Path, entry: Entry, on_exit: list[Callable[[], None]]) -> int:
    from colibri_common.serving import setup_logging

    setup_logging("serve", opts.router.log_level)
    n = opts.workers
    cores = opts.router.threads or len(os.sched_getaffinity(0))
    router_threads, worker_threads = split_threads(cores, n)
    fleet = Fleet(forks=opts.forks, entry=entry)
    # The worker plane's credential: the user's ($COLIBRI_FLEET_TOKEN) or a fresh one; calls without it are
    # refused by the workers unread. It reaches the children in their environment, never their argv.
    fleet.plane_env[FLEET_ENV] = fleet_token() or new_token()
    stop_signal = threading.Event()

    def stop_now() -> None:
        stop_signal.set()
        fleet.wake()

    def on_signal(signum, _frame):
        # No wake (a put on the calls' queue): the handler runs on the main thread between two of its bytecodes,
        # perhaps inside that queue's lock. serve_calls polls the flag every 0.05 s, whichever thread took the
        # signal (at 0.5 s, a request sent within half a second of SIGTERM was still served).
        name = signal.Signals(signum).name
        if stop_signal.is_set():              # a second Ctrl-C: every child stops now (the router cuts its drain)
            log.info("received %s again: stopping every process now", name)
            fleet.signal_all(signal.SIGTERM)
            return
        log.info("received %s: stopping the fleet", name)
        stop_signal.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    cfg = ModelConfig.from_dir(opts.router.model)   # an unusable config.json fails here, before any child starts
    if n > cfg.num_experts:                      # as would more workers than experts: one line, not one per child
        raise ConfigError(f"--workers {n}: {cfg.num_experts} experts a layer leave workers without any; give at "
                          f"most {cfg.num_experts}")
    if opts.on_gpus:                             # so does a GPU this machine lacks: one line, not one a child
        from colibri_common.device import check_device

        for name in dict.fromkeys(opts.device(c) for c in (None, *range(n))):
            check_device(name)
    if fleet.forks:
        t0 = time.monotonic()
        preload(SERVICE_MODULES + (FRONT_MODULES if opts.openai_port is not None else ()))
        log.info("imported the services in %.1fs; forking the children", time.monotonic() - t0)
    if opts.tls_self_signed:
        from colibri_common.tls import self_signed

        base = os.environ.get("COLIBRI_CACHE_DIR") or tempfile.gettempdir()
        tls = self_signed(Path(base) / f"tls-{os.getpid()}")
        on_exit.append(tls.remove)
        opts = replace(opts, router=replace(opts.router, tls_cert=tls.cert, tls_key=tls.key, tls_ca=tls.ca))
        log.info("TLS: a throw-away CA at %s (clients: --tls-ca %s)", tls.ca, tls.ca)
    try:
        # Every child starts at once (the router loads its weights while the workers load theirs, and waits
        # for them): the workers get their ports up front, so the router knows where to find them.
        t_start = time.monotonic()
        ports = free_ports(n)
        procs = [fleet.spawn("expert", opts.expert(i, worker_threads, ports[i], sockets)) for i in range(n)]
        workers = tuple(f"127.0.0.1:{port}" for port in ports)
        router = fleet.spawn("router", opts.router_options(workers, router_threads))
        addrs, ready_s = [], []
        for i, p in enumerate(procs):
            addrs.append(fleet.wait_ready(p, f"expert worker {i}/{n}"))
            ready_s.append(time.monotonic() - t_start)
        addr = fleet.wait_ready(router, "router")
        front = None
        if opts.openai_port is not None:
            front = fleet.spawn("openai", opts.front(addr))
            http = fleet.wait_ready(front, "OpenAI front")
            print(f"openai http://{http}/v1", flush=True)
    except (RuntimeError, OSError) as exc:
        log.error("%s", exc)
        fleet.stop()
        return 1
    cache = opts.cache.expert_cache_capacity
    log.info("fleet ready in %.1fs (workers ready after %s s; expert cache: %s)", time.monotonic() - t_start,
             ", ".join(f"{t:.1f}" for t in ready_s), cache if cache != "all" else "every expert held, in place where "
             "the checkpoint allows (each worker's log says)" if opts.cache.experts_in_place == "auto" else
             "every expert packed")
    print(f"ready {addr}", flush=True)

    def drain(p: Child) -> None:
        for _ in p.stdout:  # type: ignore[union-attr]
            pass

    def supervise(what: str, p: Child, respawn: Callable[[], Child], clean_exit_stops: bool = False) -> None:
        """A dead child is started again in its place, on its own port (clients and the router reconnect), like a
        pod restart; one that keeps dying soon after its restart waits 1, 2, 4 … 30 s before the next one
        (CrashLoopBackOff). One that cannot start again stops the fleet, and `serve` exits 1. With
        `clean_exit_stops` (the router), exit code 0 is a stop someone asked for (SIGTERM, drained): the fleet
        stops with it."""
        delay, started, restarts = 0.0, time.monotonic(), 0
        while True:
            drain(p)
            code = p.wait()
            if fleet.stopping.is_set() or stop_signal.is_set():
                return
            if code == 0 and clean_exit_stops:
                log.info("%s exited with code 0 (it was stopped); stopping the fleet", what)
                stop_now()
                return
            quick = time.monotonic() - started < 60          # died soon after its (re)start
            delay = min(30.0, max(1.0, 2 * delay)) if quick and restarts else 0.0
            restarts = restarts + 1 if quick else 0
            log.error("%s exited with code %s%s; restarting it in %.0fs", what, code, exit_reason(code), delay)
            if stop_signal.wait(delay):
                return
            if code == EXIT_RESTART:           # its files changed: started again once a copy still under way ends
                files_settled(opts.router.model, stop_signal)
                if stop_signal.is_set():
                    return
            started = time.monotonic()
            try:
                p = respawn()
                fleet.wait_ready(p, what)
                log.info("%s is back", what)
            except (RuntimeError, OSError) as exc:      # OSError: no fork (EAGAIN, ENOMEM) or no exec
                if fleet.stopping.is_set():
                    return
                fatal.append(str(exc))
                log.error("%s; stopping the fleet", exc)
                stop_now()
                return

    def port_of(address: str) -> int:
        return int(address.rsplit(":", 1)[1])

    def respawn_worker(i: int) -> Child:
        return fleet.spawn("expert", opts.expert(i, worker_threads, port_of(addrs[i]), sockets))

    def respawn_router() -> Child:
        current["router"] = fleet.spawn("router", replace(opts.router_options(workers, router_threads),
                                                          port=port_of(addr)))
        return current["router"]

    def respawn_front() -> Child:
        current["front"] = fleet.spawn("openai", replace(opts.front(addr), port=port_of(http)))
        return current["front"]

    fatal: list[str] = []
    current: dict[str, Child] = {"router": router}
    for i, p in enumerate(procs):
        threading.Thread(target=supervise, args=(f"expert worker {i}/{n}", p, partial(respawn_worker, i)),
                         daemon=True).start()
    threading.Thread(target=supervise, args=("the router", router, respawn_router, True), daemon=True).start()
    if front is not None:
        current["front"] = front
        threading.Thread(target=supervise, args=("the OpenAI front", front, respawn_front), daemon=True).start()
    fleet.serve_calls(until=stop_signal)
    # The front and the router drain together (the front's open streams are the router's open requests).
    router = current["router"]
    first = (router,) if front is None else (current["front"], router)
    fleet.stop(first=first, first_timeout=opts.router.grace_period + 10)
    if fatal:                             # stopped for a reason of its own, not a signal: the exit code says so
        return 1
    if router.returncode != 0:            # it died, or did not drain and exit cleanly when told to stop
        log.error("router exited with code %s", router.returncode)
        return 1
    return 0

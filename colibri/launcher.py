"""`colibri serve`: the whole fleet on one machine — N expert workers and a router as child processes.

Each child is a visible process named by its role (`colibri expert --shard I/N …`, `colibri router …`),
gets an explicit thread count, and dies with the launcher (PR_SET_PDEATHSIG), so no orphans remain. On CPUs
the children are forked from the launcher once it has imported the services (`colibri.fork`): one import
of torch for the fleet instead of one per child. With GPUs each child is a fresh `colibri` process.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

from colibri import leftovers
from colibri.cores import split_threads, worker_cpus
from colibri.fleet import Child, Fleet, check_ports_free, exit_reason, free_ports
from colibri.fork import FRONT_MODULES, SERVICE_MODULES, Entry, preload
from colibri.serve_options import ServeOptions
from colibri_common.config import ModelConfig
from colibri_common.cpus import format_cpu_list
from colibri_common.errors import ConfigError
from colibri_common.file_watch import EXIT_RESTART, files_settled
from colibri_common.fleet_token import ENV as FLEET_ENV
from colibri_common.fleet_token import fleet_token, new_token
from colibri_common.heap import importing

log = logging.getLogger("colibri.serve")


def serve(opts: ServeOptions, entry: Entry) -> int:
    """Run the fleet until a signal (or a fatal failure); its workers' same-host sockets live in a directory of
    their own (mode 0700), removed when the fleet stops. `entry` is what forked children run (colibri.cli.main)."""
    sockets = Path(tempfile.mkdtemp(prefix=leftovers.fleet_prefix()))
    on_exit: list[Callable[[], None]] = []
    try:
        return _serve(opts, sockets, entry, on_exit)
    finally:
        shutil.rmtree(sockets, ignore_errors=True)
        for undo in on_exit:                    # the throw-away TLS files
            undo()


def _stopped_while_starting(fleet: Fleet) -> int:
    """A signal came before the fleet was ready: every child stops, `ready` is never printed, and serve exits 0 as
    a stop after ready does (it had printed `ready`, then stopped; a child killed mid-start made it exit 1)."""
    log.info("stopping: the signal came while the fleet started; it was not ready")
    fleet.stop()
    return 0


def _serve(opts: ServeOptions, sockets: Path, entry: Entry, on_exit: list[Callable[[], None]]) -> int:
    from colibri_common.serving import setup_logging

    t0 = time.monotonic()
    setup_logging("serve", opts.router.log_level)
    leftovers.sweep(Path(tempfile.gettempdir()), Path(os.environ.get("COLIBRI_CACHE_DIR") or tempfile.gettempdir()))
    n = opts.workers
    allowed = os.sched_getaffinity(0)
    cores = opts.router.threads or len(allowed)
    router_threads, worker_threads = split_threads(cores, n)
    cpus = worker_cpus(allowed, cores, n) if opts.worker_cpus == "auto" and not opts.on_gpus else [()] * n
    fleet = Fleet(forks=opts.forks, entry=entry)
    # The worker plane's credential: the user's ($COLIBRI_FLEET_TOKEN) or a fresh one; calls without it are
    # refused by the workers unread. It reaches the children in their environment, never their argv.
    fleet.plane_env[FLEET_ENV] = fleet_token() or new_token()
    stop_signal = threading.Event()
    said_ready = threading.Event()

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
        if not said_ready.is_set():           # nothing to drain yet: the children stop now (one may be stuck
            fleet.signal_all(signal.SIGTERM)  # starting, and serve waits on each in turn)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:  # (nohup's ignore stays)
        signal.signal(signal.SIGHUP, on_signal)   # its terminal closed: the ordered stop (it died, children and all)
    cfg = ModelConfig.from_dir(opts.router.model)   # an unusable config.json fails here, before any child starts
    with importing():                               # torch: not when this module loads, and with the collector off
        from colibri_common.checkpoint import Checkpoint  # (about a million objects: 0.1 s of collections otherwise)

    Checkpoint(opts.router.model).close()           # so do missing or truncated weight files (one line, not one
    #                                                 a child)
    check_ports_free(opts.fixed_ports())
    if n > cfg.num_experts:                      # as would more workers than experts: one line, not one per child
        raise ConfigError(f"--workers {n}: {cfg.num_experts} experts a layer leave workers without any; give at "
                          f"most {cfg.num_experts}")
    if opts.on_gpus:                             # so does a GPU this machine lacks: one line, not one a child
        from colibri_common.device import check_device

        gpus = ",".join(map(str, opts.gpus))     # the flag the user gave is the one named
        for name in dict.fromkeys(opts.device(c) for c in (None, *range(n))):
            if opts.gpus:
                check_device(name, f"--gpus {gpus} ({name})", "leave --gpus out (the CPU)")
            else:
                check_device(name)
    if fleet.forks:
        preload(SERVICE_MODULES + (FRONT_MODULES if opts.openai_port is not None else ()))
        log.info("imported torch and the services in %.2fs; forking the children", time.monotonic() - t0)
    if stop_signal.is_set():                     # stopped before a child was started: none is
        log.info("stopping: the signal came before the fleet started")
        return 0
    if opts.tls_self_signed:
        from colibri_common.tls import self_signed

        tls = self_signed(Path(os.environ.get("COLIBRI_CACHE_DIR") or tempfile.gettempdir()) / leftovers.tls_name())
        on_exit.append(tls.remove)
        opts = replace(opts, router=replace(opts.router, tls_cert=tls.cert, tls_key=tls.key, tls_ca=tls.ca))
        log.info("TLS: a throw-away CA at %s (clients: --tls-ca %s)", tls.ca, tls.ca)
    try:
        # Every child starts at once (the router loads its weights while the workers load theirs, and waits
        # for them): the workers get their ports up front, so the router knows where to find them.
        t_start = time.monotonic()
        # --metrics-port 0: the metrics ports are chosen here too (all at once: none repeats), so a child started
        # again serves its metrics where it did
        any_metrics = opts.router.metrics_port == 0
        chosen = free_ports(2 * n + 1 if any_metrics else n, frozenset(p for _, _, p in opts.fixed_ports()))
        ports, mports = chosen[:n], [*chosen[n:]] if any_metrics else [None] * (n + 1)
        # (not put into opts: its port checks read P + 1 + i as the workers' ports, which these are not)
        procs = [fleet.spawn("expert", opts.expert(i, worker_threads, ports[i], sockets, mports[i], cpus[i]))
                 for i in range(n)]
        workers = tuple(f"127.0.0.1:{port}" for port in ports)
        router = fleet.spawn("router", opts.router_options(workers, router_threads, mports[n]))
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
        if stop_signal.is_set():                 # a child the signal stopped first: the stop asked for, no error
            return _stopped_while_starting(fleet)
        log.error("%s", exc)
        fleet.stop()
        return 1
    if stop_signal.is_set():                     # Ctrl-C or SIGTERM while the children started: never said ready
        return _stopped_while_starting(fleet)
    cache = opts.cache.expert_cache_capacity
    if any(cpus):
        log.info("workers' CPUs: %s (--worker-cpus auto; the router runs on any)",
                 ", ".join(f"worker {i} on CPU {format_cpu_list(c)}" for i, c in enumerate(cpus)))
    log.info("fleet ready in %.1fs (workers ready after %s s; expert cache: %s)", time.monotonic() - t_start,
             ", ".join(f"{t:.1f}" for t in ready_s), cache if cache != "all" else "every expert held, in place where "
             "the checkpoint allows (each worker's log says)" if opts.cache.experts_in_place == "auto" else
             "every expert packed")
    said_ready.set()
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
            # exit 0: it was stopped (someone's SIGTERM), not a crash
            log.log(logging.WARNING if code == 0 else logging.ERROR, "%s exited with code %s%s; restarting it in "
                    "%.0fs", what, code, " (stopped from outside serve)" if code == 0 else exit_reason(code), delay)
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
        return fleet.spawn("expert", opts.expert(i, worker_threads, port_of(addrs[i]), sockets, mports[i], cpus[i]))

    def respawn_router() -> Child:
        current["router"] = fleet.spawn("router", replace(opts.router_options(workers, router_threads, mports[n]),
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

"""`colibri serve`'s options: the router's, and what serve adds (the workers it starts, their replicas, GPUs,
the HTTP front); each child's options are derived from them (`expert`, `router_options`, `front`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from colibri.openai_api.options import OpenAIOptions, check_model_name
from colibri.openai_api.policy import host_entry, origin_entry
from colibri_common.cpus import format_cpu_list
from colibri_common.flags import option
from colibri_common.options import shared_fields
from expert_service.options import ExpertCacheOptions, ExpertOptions
from router_service.api.options import RouterOptions

SPAWNS = ("auto", "fork", "exec")
WORKER_HOST = "127.0.0.1"        # serve's workers listen on loopback: only its router calls them


@dataclass(frozen=True)
class ServeOptions:
    """`colibri serve`: the router's options (its worker addresses come from the workers it starts) + N."""

    # serve starts the workers itself (--workers N), so the router's ways of finding them are not its flags, and
    # its --replicas is the router's --expert-replicas
    EXCLUDED = ("router.workers", "router.follow_workers", "router.follow_interval", "router.expert_replicas")
    HELPS = {"router.threads": "cores to split between the router and the workers (0 = all cores)",
             "router.metrics_port": "serve the router's Prometheus metrics on this port P, and worker i's on "
                                    "P + 1 + i (default: off; 0 = free ports chosen at start, each kept across its "
                                    "child's restarts)"}

    router: RouterOptions = RouterOptions()
    workers: int = option(2, "number of expert workers (shards) to start")
    replicas: int = option(1, "every expert on this many distinct workers: with 2, a dead worker's tokens go "
                              "to the others and no stream notices")
    tls_self_signed: bool = option(False, "make a throw-away CA and certificate (in $COLIBRI_CACHE_DIR/"
                                          "tls-SCOPE-PID or a temp dir; logged) and serve with mutual TLS between "
                                          "router and workers and TLS to clients")
    gpus: tuple[int, ...] = option((), "GPUs to place the fleet on: the router on the first, worker i on GPU "
                                       "i mod the count (each child gets --device cuda:N)", metavar="N[,N...]")
    cache: ExpertCacheOptions = ExpertCacheOptions()
    openai_port: int | None = option(None, "also start the OpenAI-compatible HTTP front (`colibri openai`) on "
                                           "this port of the router's host (0 = any free port)")
    served_model_name: str | None = option(None, "with --openai-port: the model's name in the HTTP API (default: "
                                                 "the checkpoint directory's name)")
    allowed_hosts: tuple[str, ...] = option((), "with --openai-port: the Host names the front answers (a Service, "
                                                "an ingress, a proxy name), in place of its defaults (the --host "
                                                "address, localhost, 127.0.0.1 and [::1]; on 0.0.0.0 or :: also "
                                                "this machine's addresses and host name): list those you keep; "
                                                "'*' = any",
                                            metavar="H[,H...]")
    allowed_origins: tuple[str, ...] = option((), "with --openai-port: web origins whose pages may call the front "
                                                  "(CORS); default none", metavar="O[,O...]")
    generation_config: str = option("auto", "with --openai-port: 'auto' gives requests that leave sampling "
                                            "fields out the checkpoint's generation_config.json values (as "
                                            "vLLM); 'vllm': OpenAI's defaults", choices=("auto", "vllm"))
    worker_cpus: str = option("auto", "auto: where the workers split every CPU this process may use between them "
                                      "(--threads 0 or their count, as many CPUs as workers or a multiple), each "
                                      "runs on a block of its own, a socket's cores and a core's twin threads "
                                      "together (`colibri expert --cpus`; the router runs on any): on 2 cores the "
                                      "scheduler otherwise often queues a layer's two workers on one core while the "
                                      "other idles; off: wherever the OS puts them", choices=("auto", "off"))
    spawn: str = option("auto", "how the children start: 'fork' them from serve once it has imported torch and "
                                "the services (one import for the fleet, pages shared), or 'exec' a fresh "
                                "`colibri` for each; 'auto' forks on CPUs and execs with GPUs (CUDA cannot "
                                "cross a fork)", choices=SPAWNS)

    def __post_init__(self) -> None:
        if self.openai_port is not None and not 0 <= self.openai_port <= 65535:
            raise ValueError(f"--openai-port must be in [0, 65535], got {self.openai_port}")
        if self.workers <= 0:
            raise ValueError(f"--workers must be positive, got {self.workers}")
        if self.generation_config not in ("auto", "vllm"):
            raise ValueError(f"--generation-config must be auto or vllm, got {self.generation_config!r}")
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
        if self.worker_cpus not in ("auto", "off"):
            raise ValueError(f"--worker-cpus must be auto or off, got {self.worker_cpus!r}")
        if self.spawn not in SPAWNS:
            raise ValueError(f"--spawn must be one of {', '.join(SPAWNS)}, got {self.spawn!r}")
        if self.spawn == "fork" and self.on_gpus:
            raise ValueError("--spawn fork is for CPU fleets: a CUDA context cannot cross a fork (use exec)")
        self._check_front()
        self._check_ports()

    def _check_front(self) -> None:
        """The HTTP front's flags, checked here rather than once the fleet has loaded."""
        given = [flag for flag, v in (("--served-model-name", self.served_model_name),
                                      ("--allowed-hosts", self.allowed_hosts),
                                      ("--allowed-origins", self.allowed_origins)) if v is not None and v != ()]
        if given and self.openai_port is None:
            raise ValueError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for the HTTP front: give "
                             f"--openai-port too, or leave {'it' if len(given) == 1 else 'them'} out")
        check_model_name(self.served_model_name)
        for entry in self.allowed_hosts:
            host_entry(entry)
        for entry in self.allowed_origins:
            origin_entry(entry)

    def fixed_ports(self) -> list[tuple[str, str, int]]:
        """(what, host, port) of every port serve's processes listen on that the flags fix (0: chosen at start)."""
        r, mport = self.router, self.router.metrics_port
        ports = [("--port", r.host, r.port), ("--openai-port", r.host, self.openai_port or 0),
                 ("--metrics-port", r.host, mport or 0)]
        if mport:
            ports += [(f"worker {i}'s metrics port (--metrics-port + {1 + i})", WORKER_HOST, mport + 1 + i)
                      for i in range(self.workers)]
        return [p for p in ports if p[2]]

    def _check_ports(self) -> None:
        """The fixed ports in range and distinct, before anything starts."""
        mport = self.router.metrics_port
        if mport and mport + self.workers > 65535:
            raise ValueError(f"--metrics-port {mport}: worker i's metrics go on {mport} + 1 + i, up to "
                             f"{mport + self.workers} for {self.workers} workers, past 65535: give at most "
                             f"{65535 - self.workers}")
        seen: dict[int, str] = {}
        for what, _, port in self.fixed_ports():
            if port in seen:
                raise ValueError(f"{what} and {seen[port]} are both {port}: give each its own port (or 0 for a "
                                 f"free one)")
            seen[port] = what

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

    def expert(self, shard: int, threads: int, port: int = 0, sockets: Path | None = None,
               metrics_port: int | None = None, cpus: tuple[int, ...] = ()) -> ExpertOptions:
        """Worker `shard`'s options: the service options it shares with the router, on loopback; with `sockets`
        (a directory only this user enters) its same-host socket there; `metrics_port` overrides P + 1 + shard;
        `cpus` the CPUs it runs on (() = any)."""
        common = dict(shared_fields(self.router), host=WORKER_HOST, port=port, threads=threads,
                      device=self.device(shard), cpus=format_cpu_list(cpus))
        mport = self.router.metrics_port                 # the router's port P; worker i gets P + 1 + i
        if metrics_port is None and mport is not None:   # (`metrics_port`: the one serve chose, for P = 0)
            metrics_port = mport and mport + 1 + shard
        sched = self.router.sched
        return ExpertOptions(**common, shard=f"{shard}/{self.workers}", replicas=self.replicas, cache=self.cache,
                             max_step_tokens=max(sched.max_num_tokens, sched.max_batch_size),
                             metrics_port=metrics_port,
                             local_socket="" if sockets is None else str(sockets / f"worker-{shard}.sock"))

    def router_options(self, workers: tuple[str, ...], threads: int, metrics_port: int | None = None) -> RouterOptions:
        """The router's options, with `metrics_port` where serve chose it (--metrics-port 0)."""
        return replace(self.router, workers=workers, threads=threads, device=self.device(None),
                       expert_replicas=self.replicas,     # a resize keeps the replicas serve was asked for
                       metrics_port=self.router.metrics_port if metrics_port is None else metrics_port)

    def front(self, router: str) -> OpenAIOptions:
        """The HTTP front's options: on the router's host, a client of the router (its CA when TLS)."""
        assert self.openai_port is not None
        r = self.router
        return OpenAIOptions(target=router, host=r.host, port=self.openai_port,
                             served_model_name=self.served_model_name or Path(r.model).resolve().name,
                             tls_ca=r.tls_ca if r.tls_cert else None,
                             tls_cert=r.tls_cert if r.tls_client_auth else None,
                             tls_key=r.tls_key if r.tls_client_auth else None, log_level=r.log_level,
                             grace_period=r.grace_period, stream_stall_timeout=r.stream_stall_timeout,
                             allowed_hosts=self.allowed_hosts,
                             allowed_origins=self.allowed_origins, generation_config=self.generation_config)

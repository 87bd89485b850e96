"""The router's options: one frozen dataclass; `colibri router` and `colibri serve` build their flags from it."""

from __future__ import annotations

from dataclasses import dataclass

from colibri_common.flags import option
from colibri_common.options import DTYPES, GRPC_MAX_BYTES, ServiceOptions, is_address
from router_service.engine.scheduler import SchedulerConfig

TRANSPORTS = ("auto", "stream", "unary")


@dataclass(frozen=True)
class RouterOptions(ServiceOptions):
    port: int = option(50051, "port; 0 picks a free one")
    workers: tuple[str, ...] = option((), "comma-separated expert worker addresses (or --follow-workers)",
                                      metavar="HOST:PORT[,HOST:PORT...]")
    follow_workers: str = option("", "the workers are what NAME resolves to, polled every --follow-interval "
                                     "seconds (a Kubernetes headless Service: `kubectl scale` resizes the expert "
                                     "fleet); a change re-plans like `colibri workers set`", metavar="NAME:PORT")
    follow_interval: float = option(5.0, "seconds between two resolutions of --follow-workers")
    kv_cache_mb: int = option(512, "KV cache budget in MiB")
    kv_cache_blocks: int = option(0, "KV cache size in blocks; overrides --kv-cache-mb when > 0")
    block_size: int = option(16, "tokens per KV cache block")
    wire_dtype: str | None = option(None, "dtype of hidden states on the wire to the workers (default: the "
                                          "compute dtype)", choices=DTYPES)
    micro_batches: int = option(1, "split each step into this many micro-batches and overlap the router's "
                                   "attention of one with the workers' experts of another")
    transport: str = option("auto", "router → worker calls: auto = a worker's same-host UNIX socket where it "
                                    "names one this router reaches (`colibri serve`), else one bidirectional gRPC "
                                    "stream per worker; stream = always the gRPC stream; unary = one gRPC call "
                                    "per layer", choices=TRANSPORTS)
    worker_timeout: float = option(10.0, "seconds a worker may take to answer one layer before its call is "
                                         "cancelled and the step goes to replicas or fails UNAVAILABLE (a worker "
                                         "down by its health checks whose every expert has a live replica is cut "
                                         "off sooner: after two failed checks, about 1.5 s)")
    grace_period: float = option(30.0, "on SIGTERM: seconds the open requests get to finish (new ones are "
                                       "refused UNAVAILABLE, readiness is NOT_SERVING) before the router exits")
    max_prompt_bytes: int = option(1 << 20, "largest text prompt in bytes, refused before tokenizing")
    max_request_bytes: int = option(4 << 20, "largest message a client may send (gRPC receive limit)")
    max_stop_token_ids: int = option(256, "most stop_token_ids one request may give")
    max_stop_strings: int = option(16, "most stop strings one request may give")
    stream_stall_timeout: float = option(30.0, "seconds a client may leave its stream unread (the server "
                                               "cannot send) before the request is cancelled")
    quantize_dense: bool = option(False, "int8 for the router's own attention, dense MLPs, shared experts and "
                                         "lm_head too (gates and embeddings stay): less memory, less accuracy; "
                                         "weight-only, or W8A8 with --quantize w8a8")
    weights_in_place: str = option("auto", "use the embedding and lm_head where they lie in the mapped checkpoint "
                                           "(auto: on a CPU, where the checkpoint stores them in the compute "
                                           "dtype): no copy, the page cache shared with the workers and every "
                                           "restart on the host, a change of the file under it stops the router "
                                           "for a restart; off: copy them into the router's own memory",
                                   choices=("auto", "off"))
    metrics_port: int | None = option(None, "serve Prometheus metrics on http://HOST:PORT/metrics (default: off; "
                                            "0 = any free port)")
    tls_client_auth: bool = option(False, "with --tls-cert: clients must show a certificate --tls-ca signed")
    expert_metrics: bool = option(False, "count the tokens routed to every (layer, expert) in /metrics "
                                         "(colibri:moe_tokens_routed_total{layer,expert}; layers x experts "
                                         "series)")
    expert_prefetch: bool = option(False, "predict each next MoE layer's experts (its gate on this layer's "
                                          "hidden states) and send the prediction with this layer's dispatch, so "
                                          "workers with a bounded --expert-cache-capacity pack them ahead")
    expert_replicas: int = option(1, "in the router's own placement plans (workers started without --shard, and "
                                     "every resize or rebalance): each expert on this many distinct workers")
    redundant_experts: int = option(0, "per MoE layer, give this many of the hottest experts (by the measured "
                                       "load) one more replica each, on the least-loaded workers (EPLB)")
    placement_window: int = option(256, "steps over which each expert's routed tokens and each worker's pairs "
                                        "are counted, for placement from load and the balance metric")
    rebalance_interval: float = option(0.0, "seconds between re-plans from the measured load, switched like a "
                                            "resize (0 = only when asked: `colibri workers rebalance`)")
    replan_dead_after: float = option(0.0, "plan out a worker whose health checks have failed this many seconds: "
                                           "its experts move to the others, so a lost worker stops failing "
                                           "requests (with --follow-workers it is planned in again once it serves); "
                                           "0 = never (requests that need it fail until it is back)")
    worker_load_timeout: float = option(600.0, "seconds a worker may take to load the experts a new plan gives "
                                               "it before the change is rolled back (one that answers no health "
                                               "check for 10 s meanwhile rolls it back then)")
    enforce_eager: bool = option(False, "GPU: run every decode step op by op; by default, with the experts in "
                                        "this process, decode steps are captured as CUDA graphs (one per batch "
                                        "size, at start) and replayed")
    sched: SchedulerConfig = SchedulerConfig()

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("kv_cache_mb", "block_size", "micro_batches"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"--metrics-port must be in 0..65535, got {self.metrics_port}")
        if self.kv_cache_blocks < 0:
            raise ValueError(f"--kv-cache-blocks must be >= 0, got {self.kv_cache_blocks}")
        if self.quantize_dense and self.device != "cpu":
            raise ValueError("--quantize-dense is the CPU path (int8 CPU kernels); on a GPU keep the dense "
                             "layers in the compute dtype")
        for address in self.workers:     # a bare name was dialled for minutes ("Domain name not found")
            if not is_address(address):
                raise ValueError(f"--workers {address}: give each expert worker as HOST:PORT (the port of its "
                                 f"`colibri expert`; an IPv6 host in brackets: [::1]:50061)")
        if self.workers and self.follow_workers:
            raise ValueError("give the expert workers as --workers HOST:PORT[,...] or --follow-workers NAME:PORT, "
                             "not both")
        if not self.follow_interval > 0:
            raise ValueError(f"--follow-interval must be positive, got {self.follow_interval}")
        if self.expert_replicas < 1 or self.placement_window < 1:
            raise ValueError(f"--expert-replicas and --placement-window must be positive, got "
                             f"{self.expert_replicas} and {self.placement_window}")
        if self.redundant_experts < 0 or self.rebalance_interval < 0:
            raise ValueError(f"--redundant-experts and --rebalance-interval must be >= 0, got "
                             f"{self.redundant_experts} and {self.rebalance_interval}")
        if self.replan_dead_after < 0:
            raise ValueError(f"--replan-dead-after must be >= 0 (0 = never), got {self.replan_dead_after}")
        for name in ("worker_timeout", "grace_period", "stream_stall_timeout", "worker_load_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        for name in ("max_prompt_bytes", "max_request_bytes", "max_stop_token_ids", "max_stop_strings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.max_request_bytes > GRPC_MAX_BYTES:
            raise ValueError(f"--max-request-bytes {self.max_request_bytes} is past gRPC's largest message "
                             f"({GRPC_MAX_BYTES} bytes, 2 GiB - 1)")
        if self.max_request_bytes < self.max_prompt_bytes + 4096:
            raise ValueError(f"--max-request-bytes ({self.max_request_bytes}) must exceed --max-prompt-bytes "
                             f"({self.max_prompt_bytes}) by the message's own few bytes (4096)")

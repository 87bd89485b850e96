"""An expert worker's options: one frozen dataclass; `colibri expert` builds its flags from it."""

from __future__ import annotations

from dataclasses import dataclass

from colibri_common.cpus import parse_cpu_list
from colibri_common.flags import option
from colibri_common.options import ServiceOptions
from colibri_common.placement import parse_shard
from expert_service.cache_capacity import check_capacity
from expert_service.cache_policy import POLICIES


@dataclass(frozen=True)
class ExpertCacheOptions:
    """How a worker holds its experts: the hot-expert cache, quantised experts kept or not (`serve` gives every
    worker the same)."""

    expert_cache_capacity: str = option("all", "experts kept packed and ready: all, N in total (one pool), N/layer, "
                                               "a share of this worker's experts (25%) or bytes (2GiB), a share or "
                                               "bytes split evenly over the MoE layers; the rest stay mapped from "
                                               "the checkpoint and are packed when a call needs them",
                                        metavar="all|N|N/layer|P%|BYTES")
    expert_cache_policy: str = option("lru", "which hot expert a miss evicts: least recently used, or least "
                                             "frequently used with aging (--expert-cache-half-life)", choices=POLICIES)
    expert_cache_half_life: float = option(256.0, "LFU: accesses after which an expert's past use counts half")
    expert_cache_host_capacity: str = option("off", "GPU workers with a bounded cache: experts also kept in pinned "
                                                    "host memory (a warm tier: a GPU miss found there is one copy; "
                                                    "its slots are pinned at start)",
                                             metavar="off|all|N|N/layer|P%|BYTES")
    expert_cache_heat: str = option("auto", "JSON file of the hottest experts, written on stop and packed on the next "
                                            "start before ready ('auto' = one per checkpoint and shard beside the "
                                            "CPU forms file; 'off' = start cold)", metavar="PATH|auto|off")

    quantized_experts: str = option("auto", "an FP8 or MXFP4 checkpoint's experts: keep them as published (FP8 "
                                            "with block scales, half the bytes of bf16; MXFP4, 4.25 bits a weight) "
                                            "for the Triton kernels, which decode each tile as they load it; "
                                            "dequantize them to the compute dtype as they are packed; or auto: keep "
                                            "on a CUDA GPU (FP8 where it has FP8, compute capability 8.9+), else "
                                            "dequantize", choices=("auto", "keep", "dequantize"))

    experts_in_place: str = option("auto", "compute the experts where they lie in the mapped checkpoint (auto: "
                                           "where its experts are bf16 or float32 in the compute dtype, row-major, "
                                           "and the native CPU kernels run): no packed copy, the page cache shared "
                                           "by every worker and restart on the host; off: pack them into the "
                                           "worker's own memory (a checkpoint on a network filesystem, or pages the "
                                           "host must not evict)", choices=("auto", "off"))

    def __post_init__(self) -> None:
        check_capacity(self.expert_cache_capacity)
        if self.expert_cache_host_capacity != "off":
            check_capacity(self.expert_cache_host_capacity)
        if not self.expert_cache_half_life > 0:
            raise ValueError(f"--expert-cache-half-life must be positive, got {self.expert_cache_half_life}")


@dataclass(frozen=True)
class ExpertOptions(ServiceOptions):
    port: int = option(50061, "port; 0 picks a free one")
    shard: str = option("", "I/N: this worker holds shard I of N (0-based), a static plan; without it the worker "
                            "holds no experts until a router assigns them (elastic placement: `colibri workers`)",
                        metavar="I/N")
    replicas: int = option(1, "with --shard: every expert lives on this many distinct workers; this worker holds "
                              "the experts of shards I, I-1, … I-R+1 (mod N)")
    max_experts: int = option(0, "the most experts of one MoE layer a router may assign this worker (its memory "
                                 "budget for a plan: redundant replicas of hot experts stop there); 0 = no limit")
    metrics_port: int | None = option(None, "serve Prometheus metrics on http://HOST:PORT/metrics (default: off; "
                                            "0 = any free port)")
    max_streams: int = option(16, "concurrent ForwardStream (and Forward) calls at most; beyond it "
                                  "RESOURCE_EXHAUSTED (each router holds one stream per worker)")
    max_streams_per_peer: int = option(8, "ForwardStream (and Forward) calls one peer host may hold open at once; "
                                          "beyond it RESOURCE_EXHAUSTED, so one caller cannot take every slot")
    max_step_tokens: int = option(512, "token rows one Forward may carry: the router's --max-num-tokens (or "
                                       "--max-batch-size when larger; `serve` passes it). A larger message is "
                                       "refused before it is read, and a router that may send more is refused at "
                                       "start")
    local_socket: str = option("", "also answer Forward on this UNIX socket, for a router on the same host (framed "
                                   "messages, no HTTP/2; `colibri serve` gives each worker one in a directory only "
                                   "its user can enter); gRPC stays for everything else", metavar="PATH")
    cpus: str = option("", "run this worker's threads on these CPUs only, as taskset -c (`serve` gives each worker a "
                           "block of its own where the workers split the machine: --worker-cpus); default: wherever "
                           "the OS puts them", metavar="LIST")
    cache: ExpertCacheOptions = ExpertCacheOptions()

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("max_streams", "max_streams_per_peer", "max_step_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"--metrics-port must be in 0..65535, got {self.metrics_port}")
        if self.cpus:
            parse_cpu_list(self.cpus)    # raises ValueError with a message that says what to fix
        if self.max_experts < 0:
            raise ValueError(f"--max-experts must be >= 0 (0 = no limit), got {self.max_experts}")
        if not self.shard:
            if self.replicas != 1:
                raise ValueError("--replicas goes with --shard: without it the router plans the replicas "
                                 "(colibri router --replicas / --redundant-experts)")
            return
        parse_shard(self.shard)      # raises ValueError with a message that says what to fix
        if not 1 <= self.replicas <= self.num_shards:
            raise ValueError(f"--replicas {self.replicas}: need 1 <= R <= N (the {self.num_shards} workers)")

    @property
    def shard_index(self) -> int:
        return parse_shard(self.shard)[0]

    @property
    def num_shards(self) -> int:
        return parse_shard(self.shard)[1]

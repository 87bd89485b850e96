"""The composition root of the router: weights, KV cache sizing, scheduler, experts client → an `Engine`.

Lives apart from the gRPC server, so benchmarks and tests build an engine in-process
(`build_engine(opts, lambda cfg, device: LocalExperts(...))`) without importing the server.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from colibri_common.chat_template import load_chat_template
from colibri_common.checkpoint import Checkpoint
from colibri_common.config import ModelConfig
from colibri_common.device import open_device
from colibri_common.errors import ConfigError
from colibri_common.file_watch import FileWatch
from colibri_common.fleet_token import fleet_token
from colibri_common.forms_file import tune_forms
from colibri_common.heap import return_free_heap
from colibri_common.sampling_defaults import sampling_defaults
from colibri_common.serving import MAX_MESSAGE_BYTES
from colibri_common.tensors import summarise, unused_tensors
from colibri_common.tls import TlsFiles
from colibri_common.tokenizer import Tokenizer
from kernels import cpu_has_fast_bf16, forms_in_force, native, set_batch_invariant
from router_service.api.options import RouterOptions
from router_service.engine.block_allocator import BlockAllocator
from router_service.engine.engine import Engine
from router_service.engine.scheduler import Scheduler
from router_service.model.decode_graphs import DecodeGraphs, why_not
from router_service.model.kv_cache import KVCache
from router_service.model.model import RouterModel, routing_of
from router_service.model.native_check import check_decoder_ops
from router_service.model.weights import RouterWeights
from router_service.moe.experts import Experts
from router_service.moe.remote import RemoteExperts

log = logging.getLogger("colibri.router")

ExpertsFactory = Callable[[ModelConfig, torch.device], Experts]     # (model, the router's device)


@dataclass
class BuiltEngine:
    """Everything the router's front end needs, built and wired."""

    cfg: ModelConfig
    opts: RouterOptions
    tokenizer: Tokenizer | None
    compute_dtype: torch.dtype
    experts: Experts
    engine: Engine
    chat_template: str | None = None           # the checkpoint's, handed to the OpenAI front in ModelInfo
    special_tokens: dict[str, str] = dataclasses.field(default_factory=dict)
    sampling_defaults: dict[str, float] = dataclasses.field(default_factory=dict)   # generation_config.json's
    _settling: threading.Thread | None = dataclasses.field(default=None, init=False, repr=False)
    _closing: threading.Event = dataclasses.field(default_factory=threading.Event, init=False, repr=False)

    @property
    def mapped(self) -> FileWatch | None:
        """The checkpoint files of the weights the model uses in place (its reads are guarded by them)."""
        return self.engine.model.mapped

    @property
    def max_model_len(self) -> int:
        return self.engine.limits.max_model_len

    def settle(self) -> None:
        """Once it serves: what start-up leaves for later, in a thread of its own. On a CPU, the router's copied
        weights go onto 2 MiB pages (RouterWeights.onto_huge_pages): fresh 2 MiB pages took 20-270 ms to fault in on
        the VMs measured, which start → ready should not wait for. Not a daemon: a daemon thread stopped by the
        interpreter's exit inside a torch copy aborts the process ("terminate called without an active exception");
        `close` stops it between layers and waits for it."""
        model = self.engine.model
        if model.device.type == "cpu" and self._settling is None and not self._closing.is_set():
            self._settling = threading.Thread(target=_onto_huge_pages, args=(model, self._closing),
                                              name="router-huge-pages")
            self._settling.start()

    def close(self) -> None:
        """Stop the engine (open requests end UNAVAILABLE), then close the connections to the workers; the
        process's batch invariance ends with the engine that set it."""
        self._closing.set()
        if self._settling is not None and self._settling is not threading.current_thread():
            self._settling.join()                      # the layer being moved, then it stops
        self.engine.stop()
        set_batch_invariant(False)
        self.experts.close()
        if self.mapped is not None:
            self.mapped.close()


def compute_dtype(requested: torch.dtype, device: torch.device | None = None) -> torch.dtype:
    """Without native bf16 arithmetic torch's bf16 GEMMs are emulated: where Colibri's native kernels are not
    built, the router's dense GEMMs run far faster in float32 (batch > 4; the workers keep bf16 experts and the
    wire stays bf16). The native kernels widen bf16 weights in registers and accumulate in float32 on any CPU,
    so with them the router keeps bf16 (half the bytes a decode step reads: 310 MB, not 416, on the bench
    model). A GPU computes in what was asked."""
    on_cpu = device is None or device.type == "cpu"
    if requested == torch.bfloat16 and on_cpu and not cpu_has_fast_bf16() and not native.available():
        log.info("this CPU has no native bf16 arithmetic: the router computes in float32")
        return torch.float32
    return requested


def remote_experts(opts: RouterOptions, workers: tuple[str, ...] = ()) -> ExpertsFactory:
    """The workers' experts client: `workers` (default `opts.workers`) as the first set."""
    tls = TlsFiles.of(opts.tls_cert, opts.tls_key, opts.tls_ca)

    def connect(cfg: ModelConfig, device: torch.device) -> RemoteExperts:
        wire_dtype = getattr(torch, opts.wire_dtype or opts.dtype_for(cfg.torch_dtype))
        rows = max(opts.sched.max_num_tokens, opts.sched.max_batch_size)
        if rows * cfg.hidden_size * 8 > MAX_MESSAGE_BYTES:       # a worker's float64 sums for a whole step
            raise ConfigError(f"--max-num-tokens {rows}: a step's MoE sums from one worker ({rows} x hidden "
                              f"{cfg.hidden_size} x 8 bytes, float64) would exceed the {MAX_MESSAGE_BYTES >> 20} MiB "
                              f"message limit between router and workers; lower it to at most "
                              f"{MAX_MESSAGE_BYTES // (cfg.hidden_size * 8)}")
        return RemoteExperts(cfg, workers or opts.workers, wire_dtype, opts.transport, opts.worker_timeout,
                             expect_quantize=opts.quantize, device=device, track_routing=opts.expert_metrics, tls=tls,
                             batch_invariant=opts.batch_invariant, token=fleet_token(), step_tokens=rows,
                             replicas=opts.expert_replicas, window_steps=opts.placement_window,
                             checkpoint=Checkpoint(opts.model).fingerprint(), load_timeout_s=opts.worker_load_timeout,
                             expect_dtype=opts.dtype_for(cfg.torch_dtype))

    return connect


def with_tokenizer_eos(cfg: ModelConfig, tokenizer: Tokenizer | None, special: dict[str, str]) -> ModelConfig:
    """`cfg` whose stop tokens also hold the tokenizer's eos_token (tokenizer_config.json / special_tokens_map.json),
    as vLLM stops on it beside generation_config.json's: a checkpoint whose config.json names no eos (or another)
    had generated past it to max_tokens."""
    eos = special.get("eos_token")
    tid = None if tokenizer is None or not eos else tokenizer.token_to_id(eos)
    if tid is None or tid in cfg.eos_token_ids or not 0 <= tid < cfg.vocab_size:
        return cfg
    log.info("stop tokens: config.json's and generation_config.json's %s, and the tokenizer's eos_token %r (id %d), "
             "as vLLM stops", list(cfg.eos_token_ids), eos, tid)
    return dataclasses.replace(cfg, eos_token_ids=(*cfg.eos_token_ids, tid))


def log_unused(model: str, cfg: ModelConfig, ckpt: Checkpoint) -> None:
    """Stored tensors the config leaves unread: a warning, as transformers warns (they may mean a config.json that
    is not this checkpoint's); the multi-token prediction layers a config declares: a line."""
    unused, nextn = unused_tensors(cfg, ckpt.entries.keys())
    if unused:
        log.warning("%s: %d stored tensors that config.json leaves unread (%s): transformers leaves them out too; "
                    "if they should be read, check config.json (num_hidden_layers, the keys that turn on biases "
                    "or qk-norm)", model, len(unused), summarise(unused))
    if nextn:
        log.info("%s: the %d tensors of %d multi-token prediction layer(s) past num_hidden_layers are not served",
                 model, len(nextn), cfg.nextn_layers)


def build_engine(opts: RouterOptions, experts: ExpertsFactory) -> BuiltEngine:
    cfg = ModelConfig.from_dir(opts.model)
    device = open_device(opts.device)
    dtype = compute_dtype(getattr(torch, opts.dtype_for(cfg.torch_dtype)), device)
    tokenizer = Tokenizer.from_dir(opts.model)
    if tokenizer is not None and tokenizer.vocab_size > cfg.vocab_size:
        raise ConfigError(f"{opts.model}/tokenizer.json has {tokenizer.vocab_size} tokens but config.json "
                          f"vocab_size is {cfg.vocab_size}; they must agree")
    ckpt = Checkpoint(opts.model)
    log_unused(opts.model, cfg, ckpt)
    weights = RouterWeights.load(ckpt, cfg, dtype, progress=log.isEnabledFor(logging.INFO), device=device,
                                 in_place=opts.weights_in_place == "auto")
    if opts.quantize_dense:
        asked = getattr(torch, opts.dtype_for(cfg.torch_dtype))
        weights.quantize_int8(w8a8=opts.quantize == "w8a8", act_dtype=asked if asked != dtype else None)
    ckpt.close(keep=weights.mapped.values())     # the files of weights used in place stay mapped, and watched
    mapped = FileWatch(sorted(set(weights.mapped.values())), ckpt.stamps) if weights.mapped else None
    set_batch_invariant(opts.batch_invariant)   # the process's linears (and its in-process experts)
    return_free_heap()                          # conversion scratch back to the OS, so RSS is what is held
    if device.type == "cpu":                    # checked (and timed, with a file) before any form runs
        rows = max(opts.sched.max_batch_size, opts.sched.max_num_tokens)
        shapes = weights.linear_shapes(dtype)
        forms, measured = tune_forms(opts.cpu_forms, shapes, max_rows=rows)
        log.info(forms.summary(measured))
        log.info("CPU forms in force (shape:kind rows:form): %s", forms_in_force(shapes, rows))
        check_decoder_ops(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim, cfg.hidden_size,
                          cfg.rotary_dim, dtype, routing_of(cfg), cfg.num_experts)
    kv_heads, k_dim, v_dim = cfg.kv_layout          # latent attention: the compressed latent, its real size
    per_block = KVCache.bytes_per_block(cfg.num_layers, opts.block_size, kv_heads, k_dim, dtype, v_dim)
    num_blocks = opts.kv_cache_blocks or max(1, opts.kv_cache_mb * 2**20 // per_block)
    spare = 1 if device.type == "cuda" else 0       # CUDA graphs' padding rows write there (decode_graphs.py)
    try:
        kv = KVCache(cfg.num_layers, num_blocks + spare, opts.block_size, kv_heads, k_dim, dtype, device, v_dim)
    except (OSError, MemoryError, OverflowError, torch.OutOfMemoryError) as exc:   # ENOMEM from the map, a size
        # past int64 (--kv-cache-mb 99999999999999999999), or a GPU's out-of-memory
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else \
            (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"the KV cache ({num_blocks + spare} blocks of {opts.block_size} tokens, "
                          f"{(num_blocks + spare) * per_block / 2**20:.0f} MiB) cannot be allocated on {device}: "
                          f"{why}; lower --kv-cache-mb / --kv-cache-blocks") from None
    sched = dataclasses.replace(opts.sched, max_model_len=min(opts.sched.max_model_len, cfg.max_position_embeddings))
    if -(-sched.max_model_len // opts.block_size) > num_blocks:
        raise ConfigError(f"--max-model-len {sched.max_model_len} needs {-(-sched.max_model_len // opts.block_size)} "
                          f"KV blocks of {opts.block_size} tokens, but the KV cache holds {num_blocks} "
                          f"({num_blocks * opts.block_size} tokens): raise --kv-cache-mb / --kv-cache-blocks or "
                          f"lower --max-model-len to {num_blocks * opts.block_size}")
    scheduler = Scheduler(sched, BlockAllocator(num_blocks, opts.block_size))
    remote = experts(cfg, device)
    model = RouterModel(cfg, weights, dtype, device)
    model.prefetch = opts.expert_prefetch
    model.batch_invariant = opts.batch_invariant
    model.track_routing = sched.routing_aware_batching
    model.mapped = mapped
    template, special = load_chat_template(opts.model)
    cfg = with_tokenizer_eos(cfg, tokenizer, special)
    engine = Engine(model, kv, scheduler, remote, cfg.eos_token_ids, opts.micro_batches)
    no_graphs = why_not(model, remote, opts.micro_batches, opts.enforce_eager)
    if no_graphs is None:
        engine.graphs = DecodeGraphs(model, kv, remote, sched.max_batch_size,
                                     -(-sched.max_model_len // opts.block_size), num_blocks, engine.window)
        with torch.cuda.device(device):
            engine.graphs.capture_all()
    elif device.type == "cuda":
        log.info("CUDA graphs: off (%s); every step runs op by op", no_graphs)
    if device.type == "cpu":
        if native.refused_override():
            raise ConfigError(native.refused_override())
        log.info(native.describe())
    log.info("%s: %d layers, %d experts top-%d, KV cache %d blocks x %d tokens (%.1f MiB), %s on %s, %s routing",
             cfg.architecture, cfg.num_layers, cfg.num_experts, cfg.top_k, num_blocks, opts.block_size,
             num_blocks * per_block / 2**20, str(dtype).removeprefix("torch."), device, model.routing_form())
    if weights.mapped:
        log.info("%s in place (mapped, %.1f MiB): read from the page cache, not copied",
                 " and ".join(sorted(weights.mapped)), weights.mapped_bytes / 2**20)
    return BuiltEngine(cfg, opts, tokenizer, dtype, remote, engine, template, special, sampling_defaults(opts.model))


def _onto_huge_pages(model: RouterModel, stop: threading.Event) -> None:
    """The router's copied weights onto 2 MiB pages, a layer at a time, while it starts and serves: each copy has the
    same bits, so a step may read a layer's old tensors or its new ones (RouterWeights.onto_huge_pages). Then the
    model forgets what it kept of the old ones (decode plans), so they go."""
    t0 = time.monotonic()
    try:
        moved = model.w.onto_huge_pages(stop)
    except (OSError, MemoryError) as exc:            # no memory for the copies: the weights stay where they are
        log.warning("router weights stay on 4 KiB pages: %s", exc)
        return
    finally:
        model.forget_weights()
    if stop.is_set():                                # closed meanwhile: the process is stopping
        log.info("router weights: %.1f MiB moved onto 2 MiB pages before the router closed", moved / 2**20)
    elif moved:
        return_free_heap()                           # the 4 KiB pages they left, back to the OS
        log.info("router weights on 2 MiB pages: %.1f MiB in %.2fs (transparent huge pages, madvise)", moved / 2**20,
                 time.monotonic() - t0)

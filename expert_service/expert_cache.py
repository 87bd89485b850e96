"""A worker's expert tiers: a bounded set of hot (packed) experts over the cold checkpoint mapping.

- **hot**: slots of packed, compute-ready experts (compute dtype or int8) on the compute device, in two
  stacks w13 [S, 2I, H] and w2 [S, H, I]; the fused MoE kernel reads them through a slot map, as it reads
  a full shard through its expert map, so Triton and the CPU forms run unchanged.
- **warm** (GPU workers only): slots of pinned host memory; a hot miss found there is one H2D copy.
- **cold**: the checkpoint's mmap; a miss packs the expert from it and drops the pages it read.

A miss is served at once: the expert is packed into a free slot or the policy's victim's (an expert the
call in progress needs is never the victim), and the call computes on it. A layer that needs more
experts than its pool has slots is computed in rounds of at most that many. Memory is bounded by the
slots: an evicted expert's packed copy is overwritten by the next one and its mapped pages are dropped.

Prefetch: `hint(layer, experts)` (the router's prediction for the next layer) packs those experts on a
thread of its own, one per lock hold, so a call waiting for the lock gets it between two packs.

Shapes: S slots, T tokens of a call, H hidden size, I expert width, K experts per token, E experts per layer.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import torch

from colibri_common.checkpoint import Checkpoint
from colibri_common.config import ModelConfig
from colibri_common.device import device_scope
from colibri_common.file_watch import FileWatch, MappingChanged
from expert_service.cache_capacity import CacheCapacity
from expert_service.cache_policy import Policy, make_policy
from expert_service.cache_stats import CacheStats
from expert_service.packing import pack_expert, will_need
from kernels import SILU, GatedAct, Weight, fused_moe

log = logging.getLogger("colibri.expert")
Key = tuple[int, int]                     # (layer, global expert id)


class Pool:
    """The slots one set of keys competes for (one per MoE layer, or one for all of them)."""

    def __init__(self, slots: list[int], policy: Policy) -> None:
        self.free, self.policy, self.size = list(reversed(slots)), policy, len(slots)


class Tier:
    """Packed experts in one memory: slots, the key in each, the pools that evict."""

    def __init__(self, cfg: ModelConfig, capacity: CacheCapacity, policy: str, half_life: float,
                 make: Callable[..., Weight]) -> None:
        L, H, I = len(cfg.moe_layers), cfg.hidden_size, cfg.moe_intermediate_size
        total = capacity.total_slots(L)
        assert total is not None, "a tier has a bounded number of slots"
        self.w13 = make(total, 2 * I, H)                                    # [S, 2I, H] untouched until filled
        self.w2 = make(total, H, I)                                         # [S, H, I]
        if capacity.per_layer:
            n = capacity.slots or 0
            pools = [Pool(list(range(i * n, (i + 1) * n)), make_policy(policy, half_life)) for i in range(L)]
            self._pool = {layer: pools[i] for i, layer in enumerate(cfg.moe_layers)}
        else:
            shared = Pool(list(range(total)), make_policy(policy, half_life))
            self._pool = {layer: shared for layer in cfg.moe_layers}
        self.slot_of: dict[Key, int] = {}
        self.expert_bytes = (self.w13.nbytes + self.w2.nbytes) // total

    def pool(self, layer: int) -> Pool:
        return self._pool[layer]

    def pools(self) -> list[Pool]:
        """Each pool once (one per layer, or one shared by all)."""
        return list({id(p): p for p in self._pool.values()}.values())

    def drop(self, key: Key) -> None:
        """Forget `key` and free its slot (a pack that failed must leave no half-written expert behind)."""
        pool = self._pool[key[0]]
        pool.policy.remove(key)
        pool.free.append(self.slot_of.pop(key))

    def take(self, key: Key, pinned: set[Key]) -> tuple[int, Key | None]:
        """A slot for `key` (admitted now): a free one, or the victim's; returns (slot, evicted key)."""
        pool = self._pool[key[0]]
        evicted = None
        if pool.free:
            slot = pool.free.pop()
        else:
            evicted = pool.policy.victim(pinned)
            pool.policy.remove(evicted)
            slot = self.slot_of.pop(evicted)
        pool.policy.admit(key)
        self.slot_of[key] = slot
        return slot, evicted

    @property
    def resident_bytes(self) -> int:
        return len(self.slot_of) * self.expert_bytes


class ExpertCache:
    def __init__(self, cfg: ModelConfig, ckpt: Checkpoint, experts: list[int], capacity: CacheCapacity,
                 policy: str, make: Callable[..., Weight], device: torch.device, half_life: float = 256.0,
                 warm: CacheCapacity | None = None, make_warm: Callable[..., Weight] | None = None) -> None:
        self.cfg, self.ckpt, self.device = cfg, ckpt, device
        ckpt.map_all()                          # every file mapped once, before any thread reads through it
        self.watch: FileWatch | None = None     # checked before each read through the mapping (build.py sets it)
        self.held = set(experts)
        self.local = torch.full((cfg.num_experts,), -1, dtype=torch.long)     # [E] global id -> local row
        self.local[experts] = torch.arange(len(experts))
        self.hot = Tier(cfg, capacity, policy, half_life, make)
        self.warm = None if warm is None or make_warm is None else Tier(cfg, warm, policy, half_life,
                                                                        make_warm)
        self.stats = CacheStats()
        self.prefetched: set[Key] = set()
        self.lock = threading.Lock()
        self._hints: queue.SimpleQueue[tuple[int, list[int]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._prefetch_loop, name="expert-prefetch", daemon=True)
        self._thread.start()

    # -- filling -------------------------------------------------------------------------------------
    def _fill(self, key: Key, pinned: set[Key], prefetch: bool) -> int:
        """Pack `key` into a hot slot (through the warm tier on GPUs); the caller holds the lock."""
        slot, evicted = self.hot.take(key, pinned)
        if evicted is not None:
            self.stats.evictions += 1
            if evicted in self.prefetched:
                self.prefetched.discard(evicted)
                self.stats.prefetch_wasted += 1
        try:
            self._pack_into(key, slot)
        except BaseException:
            self.hot.drop(key)                 # the call fails; no later call may read this slot's bytes
            raise
        if prefetch:
            self.prefetched.add(key)
            self.stats.prefetched += 1
        return slot

    def _pack_into(self, key: Key, slot: int) -> None:
        layer, e = key
        if self.watch is not None and (reason := self.watch.changed()) is not None:
            raise MappingChanged(reason)        # the pages may be gone: reading them would be SIGBUS
        if self.warm is None:
            pack_expert(self.cfg, self.ckpt, layer, e, self.hot.w13[slot], self.hot.w2[slot])
            return
        wslot = self.warm.slot_of.get(key)
        if wslot is None:
            wslot, _ = self.warm.take(key, set())
            try:
                pack_expert(self.cfg, self.ckpt, layer, e, self.warm.w13[wslot], self.warm.w2[wslot])
            except BaseException:
                self.warm.drop(key)
                raise
        else:
            self.warm.pool(layer).policy.access(key)
        # a blocking copy: the warm slot may be re-packed by the CPU as soon as the lock is let go
        self.hot.w13[slot].copy_(self.warm.w13[wslot])
        self.hot.w2[slot].copy_(self.warm.w2[wslot])

    def _ensure(self, layer: int, experts: list[int]) -> list[int]:
        """Hot slots of `experts` (global ids) of `layer`, missing ones packed now; the caller holds the lock."""
        pinned = {(layer, e) for e in experts}
        slots = []
        for e in experts:
            key = (layer, e)
            slot = self.hot.slot_of.get(key)
            self.stats.lookup(slot is not None)
            if slot is None:
                slot = self._fill(key, pinned, prefetch=False)
            else:
                self.hot.pool(layer).policy.access(key)
                if key in self.prefetched:
                    self.prefetched.discard(key)
                    self.stats.prefetch_used += 1
            slots.append(slot)
        return slots

    # -- compute -------------------------------------------------------------------------------------
    def forward(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, act: GatedAct = SILU,
                b13: torch.Tensor | None = None, b2: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H], ids [T, K] global ids (-1 or others' experts ignored), weights [T, K] -> float64 [T, H], the
        exact sum over every round's pairs (kernels.fused_moe's `acc`: no rounding between rounds); the experts'
        biases b13 [E_local, 2I], b2 [E_local, H] (rows in the held experts' order) follow them into their slots."""
        valid = ids[ids >= 0].unique().tolist()                                # experts the call names
        cap = self.hot.pool(layer).size
        with self.lock:
            # the hot ones first: a round's misses never evict an expert a later round needs and has
            need = sorted((e for e in valid if e in self.held), key=lambda e: (layer, e) not in self.hot.slot_of)
            rounds = [need[start:start + cap] for start in range(0, len(need), cap)] or [[]]
            acc = torch.zeros(x.shape, dtype=torch.float64, device=x.device)   # [T, H] every round's pairs
            for part in rounds:                                               # usually one; of at most `cap`
                slot_map = self._slot_map(layer, part)
                sb13, sb2 = self._slot_biases(slot_map, part, b13, b2)
                fused_moe(x, self.hot.w13, self.hot.w2, ids, weights, slot_map, act=act, b13=sb13, b2=sb2, acc=acc)
            return acc

    def _slot_biases(self, slot_map: torch.Tensor, experts: list[int], b13: torch.Tensor | None,
                     b2: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Per hot slot, the biases of the expert it holds for this call: [slots, 2I], [slots, H]."""
        if b13 is None or b2 is None:
            return None, None
        slots = self.hot.w13.shape[0]
        sb13 = torch.zeros(slots, b13.shape[1], dtype=b13.dtype, device=b13.device)
        sb2 = torch.zeros(slots, b2.shape[1], dtype=b2.dtype, device=b2.device)
        if experts:
            g = torch.tensor(experts)
            at, rows = slot_map[g.to(slot_map.device)].to(b13.device), self.local[g].to(b13.device)
            sb13[at], sb2[at] = b13[rows], b2[rows]
        return sb13, sb2

    def _slot_map(self, layer: int, experts: list[int]) -> torch.Tensor:
        """[E] global id -> hot slot for `experts` (packed now if missing), -1 for every other id."""
        slot_map = torch.full((self.cfg.num_experts,), -1, dtype=torch.long)
        if experts:
            slot_map[experts] = torch.tensor(self._ensure(layer, experts))
        return slot_map.to(self.device)

    # -- prefetch ------------------------------------------------------------------------------------
    def hint(self, layer: int, experts: list[int]) -> None:
        """The router predicts `layer` will need `experts` (global ids) next: pack them off the critical path."""
        mine = [e for e in experts if e in self.held]
        if mine and layer in self.cfg.moe_layers:
            with self.lock:
                self.stats.prefetch_hints += 1
            self._hints.put((layer, mine))

    def _prefetch_loop(self) -> None:
        with device_scope(self.device):
            while True:
                item = self._hints.get()
                while item is not None and not self._hints.empty():          # only the latest hint matters
                    item = self._hints.get()
                if item is None:
                    return
                layer, experts = item
                try:
                    self._prefetch(layer, experts)
                except MappingChanged:
                    return                      # the worker reports it and stops (file-watch); no more guesses
                except Exception:  # noqa: BLE001 (a prefetch is an optimisation: log it, serve on)
                    log.exception("prefetch of layer %d failed", layer)

    def _prefetch(self, layer: int, experts: list[int]) -> None:
        take = experts[:self.hot.pool(layer).size // 2]          # never push out more than half a pool on a guess
        batch = {(layer, e) for e in take}                       # nor one guess's expert for another of it
        for e in experts[len(take):]:
            will_need(self.cfg, self.ckpt, layer, e)
        for e in take:
            with self.lock:
                if (layer, e) not in self.hot.slot_of:
                    self._fill((layer, e), batch, prefetch=True)

    # -- warm start ----------------------------------------------------------------------------------
    def hottest(self) -> list[Key]:
        """The hot keys, hottest first in each pool (what a restart should pack first)."""
        with self.lock:
            return [key for pool in self.hot.pools() for key in pool.policy.ranked()]   # type: ignore[misc]

    def preload(self, keys: list[Key]) -> int:
        """Pack `keys` (hottest first) into free slots, the coldest first so the policy ranks them as given;
        keys of unknown layers or experts, or beyond a pool's free slots, are skipped. Returns how many."""
        take: list[Key] = []
        room = {id(p): len(p.free) for p in self.hot.pools()}
        for key in dict.fromkeys(keys):                                   # each key once, in order
            layer, e = key
            if layer in self.cfg.moe_layers and e in self.held and room[id(self.hot.pool(layer))]:
                room[id(self.hot.pool(layer))] -= 1
                take.append(key)
        with self.lock:
            for key in reversed(take):
                self._fill(key, set(), prefetch=False)
        return len(take)

    def close(self) -> None:
        self._hints.put(None)
        self._thread.join(timeout=5)

    @property
    def resident_bytes(self) -> dict[str, int]:
        out = {"hot": self.hot.resident_bytes}
        if self.warm is not None:
            out["warm"] = self.warm.resident_bytes
        return out

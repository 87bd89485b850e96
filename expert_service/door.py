"""The worker's native door (kernels/native_door.py) kept to the experts it serves: each change of the holding (a
plan installed, its epochs changed) publishes the table of the experts served now, and a worker that stops trusting
its experts' bytes publishes none. Its calls are answered with the Python path's bytes (expert_service/
fast_answer.py, the same native op), and anything else goes to that path: the table holds only the layers whose
experts `ExpertShard.answer_plan` gives, on the CPU, and none while the worker holds no plan (not assigned) or its
files changed under the mapping.

The metrics count the door's calls beside the Python path's (`WorkerMetrics.door`).
"""

from __future__ import annotations

import logging
import threading

from colibri_common.file_watch import MappingChanged
from colibri_common.metrics_http import TOKEN_BUCKETS
from expert_service.holding import Served
from kernels import native_door, native_wire

log = logging.getLogger("colibri.expert")


def door_table(served: Served | None, checkpoint_id: int, instance: str) -> native_door.DoorTable | None:
    """The table of the experts `served` (None where the door answers nothing: no plan, experts not in the native
    kernels' form, files changed under the mapping)."""
    if served is None or not served.assigned:
        return None
    shard = served.built.experts
    watch = shard.watch if shard.in_place else None
    if shard.dtype not in native_wire.X_DTYPES or (watch is not None and watch.reason is not None):
        return None
    layers = []
    for layer in shard.cfg.moe_layers:
        try:
            plan = shard.answer_plan(layer)
        except MappingChanged:
            return None
        if plan is None or plan.expert_map is None or plan.expert_map.numel() != shard.cfg.num_experts:
            continue
        files = () if watch is None else watch.identities(shard.layer_files[layer])
        if files is None:                                   # closed: the shard is being released
            return None
        layers.append(native_door.DoorLayer(layer, plan, files))
    if not layers:
        return None
    return native_door.DoorTable(shard.dtype, shard.cfg.hidden_size, shard.cfg.num_experts,
                                 tuple(sorted({served.epoch, *served.also})), served.digest, checkpoint_id, instance,
                                 tuple(layers))


class ExpertDoor:
    """The door of one worker, published from its holding (`Holding.publisher`)."""

    def __init__(self, checkpoint_id: int, instance: str) -> None:
        self.door = native_door.Door(TOKEN_BUCKETS)
        self.checkpoint_id, self.instance = checkpoint_id, instance
        self._stopped = False
        self._lock = threading.Lock()            # one publish at a time, the latest holding's last

    def publish(self, served: Served | None) -> None:
        with self._lock:
            try:
                table = None if self._stopped else door_table(served, self.checkpoint_id, self.instance)
                self.door.publish(table)
            except Exception:  # noqa: BLE001 (the Python path answers every call, as well)
                log.exception("the native door answers nothing from now on: its table could not be made")
                table = None
                self.door.publish(None)
            log.debug("native door: %s", "closed" if table is None else
                      f"{len(table.layers)} MoE layer(s) under epoch(s) {list(table.epochs)}")

    def stop(self) -> None:
        """Answer nothing any more (the experts' bytes are not trusted, or the worker stops): every call then goes
        to the Python path, which refuses it and says why."""
        with self._lock:
            self._stopped = True
            self.door.publish(None)

    def close(self) -> None:
        """Stopped, and the native door freed (nothing may serve through it after)."""
        self.stop()
        self.door.close()

    def stats(self) -> native_door.DoorStats:
        return self.door.stats()

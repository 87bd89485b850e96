"""The fleet's Prometheus families, from the router's view of its workers (remote.py): per worker the rows sent,
the pairs over the placement window, health, bans and re-admissions; the balance, the placement epoch and its
changes; per (layer, expert) the tokens routed only with --expert-metrics (bounded cardinality otherwise)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Protocol

import torch
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from colibri_common.metrics_http import QueuedHistogram
from router_service.moe.liveness import Liveness
from router_service.moe.load_window import LoadWindow
from router_service.moe.table import Table


class FleetView(Protocol):
    """What the families are read from (remote.RemoteExperts)."""

    dispatch_seconds: QueuedHistogram
    table: Table
    addresses: list[str]
    worker_rows: list[int]
    window: LoadWindow
    rebalances: int
    rebalance_seconds: float
    liveness: Liveness
    routed: torch.Tensor | None
    restarts: Mapping[str, int]
    lost: Mapping[str, float]
    planned_out_dead: int
    index: Mapping[str, int]


def fleet_families(remote: FleetView) -> Iterator[Metric]:
    table = remote.table
    current = [w for w in range(len(remote.addresses)) if table.in_plan(w)]
    names = {remote.addresses[w] for w in current}
    for family in remote.dispatch_seconds.collect():   # the current workers' only, as every per-worker family here
        family.samples = [s for s in family.samples if s.labels.get("worker") in names]    # (a removed one's
        yield family                                                                        # stayed for good)
    rows = CounterMetricFamily("colibri:worker_tokens", "Token rows sent to each worker.", labels=["worker"])
    for w in current:
        rows.add_metric([remote.addresses[w]], remote.worker_rows[w])
    yield rows
    names = tuple(remote.addresses[w] for w in current)
    pairs = remote.window.worker_pairs(names)
    load = GaugeMetricFamily("colibri:worker_pairs_window", "Token-expert pairs each worker computed over the "
                             "last --placement-window steps.", labels=["worker"])
    for name, n in pairs.items():
        load.add_metric([name], n)
    yield load
    yield GaugeMetricFamily("colibri:expert_balance", "Mean ÷ max token-expert pairs per worker over the last "
                            "--placement-window steps (1 = even).", value=remote.window.balance(names))
    yield GaugeMetricFamily("colibri:placement_epoch", "The placement epoch served now.", value=table.epoch)
    yield CounterMetricFamily("colibri:rebalances", "Placement changes switched to (resizes and rebalances).",
                              value=remote.rebalances)
    yield CounterMetricFamily("colibri:rebalance_seconds", "Seconds from a placement change's start to its "
                              "switch, summed.", value=remote.rebalance_seconds)
    up = GaugeMetricFamily("colibri:worker_up", "1 while the worker is sent tokens (healthy, not banned).",
                           labels=["worker"])
    bans = CounterMetricFamily("colibri:worker_bans", "Failed calls that banned the worker.", labels=["worker"])
    back = CounterMetricFamily("colibri:worker_readmissions", "Times a banned or unhealthy worker was "
                               "re-admitted.", labels=["worker"])
    restarts = CounterMetricFamily("colibri:worker_restarts", "Times a new process answered for the worker (it "
                                   "restarted) since this router started.", labels=["worker"])
    in_plan = GaugeMetricFamily("colibri:worker_in_plan", "1 for a worker of the placement served now; 0 for one "
                                "planned out because it was down (--replan-dead-after), until it is planned in again.",
                                labels=["worker"])
    live = remote.liveness.live()
    lost = [remote.index[a] for a in list(remote.lost) if a in remote.index and remote.index[a] not in current]
    for w in (*current, *lost):                 # a worker planned out while down stays, so an alert on it holds
        address = remote.addresses[w]
        up.add_metric([address], float(live[w]) if w in current else 0.0)    # (no longer checked once out)
        bans.add_metric([address], remote.liveness.bans[w])
        back.add_metric([address], remote.liveness.readmissions[w])
        restarts.add_metric([address], remote.restarts[address])
        in_plan.add_metric([address], float(w in current))
    yield from (up, bans, back, restarts, in_plan)
    yield CounterMetricFamily("colibri:workers_planned_out_dead", "Workers planned out because they were down for "
                              "--replan-dead-after seconds.", value=remote.planned_out_dead)
    if remote.routed is not None:
        routed = CounterMetricFamily("colibri:moe_tokens_routed", "Tokens routed to each expert of each "
                                     "layer (--expert-metrics).", labels=["layer", "expert"])
        for layer, e in remote.routed.nonzero().tolist():
            routed.add_metric([str(layer), str(e)], int(remote.routed[layer, e]))
        yield routed

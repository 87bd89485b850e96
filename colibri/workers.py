"""`colibri workers`: the expert workers a router serves with, and their placement (elastic expert parallelism).

    colibri workers --target ROUTER show [--json]      the workers, their state, experts and load
    colibri workers --target ROUTER set A:P,B:P,...    serve with exactly these workers (a live resize)
    colibri workers --target ROUTER add A:P            one more worker
    colibri workers --target ROUTER remove A:P         move a worker's experts away, then release it
    colibri workers --target ROUTER rebalance          re-plan from the measured load

Calls the router's Admin service with the fleet token ($COLIBRI_FLEET_TOKEN, the one the router was started
with). A change returns once the router has switched to the new placement (or rolled it back: exit 1).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass

from colibri_common.flags import comma_list, option
from colibri_common.options import check_target

ACTIONS = ("show", "set", "add", "remove", "rebalance")


@dataclass(frozen=True)
class WorkersOptions:
    action: str = option("show", "show (the default when left out) | set ADDRS | add ADDR | remove ADDR | "
                                 "rebalance", flag="action",
                         choices=ACTIONS)
    addresses: tuple[str, ...] = option((), "HOST:PORT[,HOST:PORT...] for set, add and remove", flag="addresses",
                                        metavar="ADDRS", type=lambda t: tuple(comma_list(t)))
    target: str = option("", "the router's address HOST:PORT", required=True)
    json: bool = option(False, "one JSON document instead of text: show's table, or a change's outcome (changed, "
                               "epoch, seconds, balance before/after, message)")
    timeout: float = option(900.0, "seconds to wait for a change (loading the new experts included); for show, "
                                   "at most 30")
    tls_ca: str | None = option(None, "PEM CA of a TLS router (TLS when given)", metavar="PATH")
    tls_cert: str | None = option(None, "PEM client certificate, for a router that requires one", metavar="PATH")
    tls_key: str | None = option(None, "PEM key of --tls-cert", metavar="PATH")
    tls_server_name: str | None = option(None, "the name the router's certificate carries, when it differs from "
                                               "the target's host")

    def __post_init__(self) -> None:
        check_target("--target", self.target)
        if self.action in ("set", "add", "remove") and not self.addresses:
            raise ValueError(f"`colibri workers {self.action}` needs worker addresses: HOST:PORT[,HOST:PORT...]")
        if self.action in ("show", "rebalance") and self.addresses:
            raise ValueError(f"`colibri workers {self.action}` takes no addresses")
        if any(":" not in a for a in self.addresses):
            raise ValueError(f"worker addresses are HOST:PORT, got {','.join(self.addresses)}")
        if not self.timeout > 0:
            raise ValueError(f"--timeout must be positive, got {self.timeout}")


def _table(resp) -> str:
    rows = [("WORKER", "STATE", "HELD", "TOKENS", "PAIRS (WINDOW)", "LOAD", "RESTARTS")]
    for w in resp.workers:
        rows.append((w.address, w.state, str(w.experts), str(w.token_rows), str(w.pairs_window),
                     f"{100 * w.load_share:.1f}%", str(w.restarts)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(n) for c, n in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.append("HELD: (layer, expert) pairs the worker holds (every layer's experts counted)")
    lines.append(f"placement epoch {resp.epoch}; balance {resp.balance:.3f} (mean/max pairs over the last "
                 f"{resp.placement_window} steps); {resp.replicas} replica(s), {resp.redundant_experts} redundant "
                 f"expert(s) a layer; {resp.rebalances} change(s) since start")
    if resp.last_change:
        lines.append(f"last change: {resp.last_change}")
    return "\n".join(lines)


def _patiently(call, request, timeout: float):
    """The call, tried again while the router is still loading or has too many changes queued, until `timeout`
    (a pod's preStop hook must not give up on a busy router)."""
    import grpc

    deadline = time.monotonic() + timeout
    pause = 0.5
    said = ""
    while True:
        try:
            return call(request, timeout=max(1.0, deadline - time.monotonic()))
        except grpc.RpcError as exc:
            busy = exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
            if not busy or time.monotonic() + pause > deadline:
                raise
            # nothing answering (connection refused, no route) is not a busy router: said as it is, once a reason
            details = exc.details() or ""
            unreachable = details.startswith("failed to connect")
            broke = any(m in details for m in ("Stream removed", "Socket closed", "Connection reset", "GOAWAY"))
            why = "the router cannot be reached" if unreachable else \
                "the connection to the router broke during the call (it stopped or restarted?); asking again" \
                if broke else "the router is busy"
            line = f"{why} ({exc.code().name}: {exc.details()}); trying again for up to {timeout:g} s (--timeout)"
            if why != said:
                print(line, file=sys.stderr)
                said = why
            time.sleep(pause)
            pause = min(5.0, 2 * pause)


def _plain(msg) -> dict:
    """A message as JSON-ready values, every field present (layer 0 and epoch 0 too, which protobuf's JSON form
    leaves out) and 64-bit integers as numbers (it writes them as strings)."""
    out: dict = {}
    for field in msg.DESCRIPTOR.fields:
        value = getattr(msg, field.name)
        if field.message_type is not None:
            out[field.name] = [_plain(v) for v in value] if field.is_repeated else _plain(value)
        else:
            out[field.name] = list(value) if field.is_repeated else value
    return out


def run_workers(opts: WorkersOptions) -> int:
    import grpc

    from colibri_common.fleet_token import fleet_token
    from colibri_common.pb import admin_pb2, admin_pb2_grpc
    from colibri_common.tls import client_channel
    from colibri_common.token_gate import with_token

    options = [("grpc.ssl_target_name_override", opts.tls_server_name)] if opts.tls_server_name else []
    with client_channel(opts.target, options, opts.tls_ca, opts.tls_cert, opts.tls_key) as raw:
        stub = admin_pb2_grpc.AdminStub(with_token(raw, fleet_token()))
        try:
            if opts.action == "show":
                resp = stub.ShowWorkers(admin_pb2.ShowWorkersRequest(), timeout=min(opts.timeout, 30.0))
                print(json.dumps(_plain(resp), indent=2) if opts.json else _table(resp))
                return 0
            if opts.action == "rebalance":
                request = admin_pb2.RebalanceRequest()
                call = stub.Rebalance
            else:
                names = list(opts.addresses)
                request = admin_pb2.SetWorkersRequest(workers=names if opts.action == "set" else [],
                                                      add=names if opts.action == "add" else [],
                                                      remove=names if opts.action == "remove" else [])
                call = stub.SetWorkers
            change = _patiently(call, request, opts.timeout)
        except grpc.RpcError as exc:
            if opts.json:                        # a script reads one document either way
                print(json.dumps({"changed": False, "error": {"code": exc.code().name, "message": exc.details()}},
                                 indent=2))
            print(f"{opts.target}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                where = "is set here" if fleet_token() else "is not set here"
                print(f"$COLIBRI_FLEET_TOKEN {where}: give this command the fleet's token. A `colibri serve` makes "
                      f"a token of its own unless the variable is exported before it starts (start it so to "
                      f"manage its workers)", file=sys.stderr)
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and opts.action != "show":
                print(f"the router did not answer within --timeout {opts.timeout:g} s: a change whose turn had "
                      f"not come is dropped, one under way goes on; `colibri workers show` and the router's log say "
                      f"which", file=sys.stderr)
            return 1
    if opts.json:
        print(json.dumps(_plain(change), indent=2))
    else:
        print(change.message if change.changed else f"no change: {change.message}")
    return 0

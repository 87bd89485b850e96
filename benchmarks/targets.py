"""The serving targets of the native-kernels issue (23), judged on one `benchmarks.serving` run: each Colibri row
against llama.cpp measured in that same run, the orchestration share of a one-stream fleet step and the fleet's
start → ready. A target whose engine, stream count or llama.cpp row is not in the run says "not run"; nothing is
carried over from another run (this VM moves whole runs by 15-30%).
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.common import table


@dataclass(frozen=True)
class Ratio:
    """`engine` at `streams` at least `wanted` times llama.cpp's `peer` ("bf16" or "q8_0") output tok/s."""

    engine: str
    streams: int
    peer: str
    wanted: float


RATIOS = (
    Ratio("colibri in-process", 1, "bf16", 0.9), Ratio("colibri in-process", 8, "bf16", 1.2),
    Ratio("colibri in-process", 32, "bf16", 1.2),
    Ratio("colibri 2 workers", 1, "bf16", 0.6), Ratio("colibri 2 workers", 8, "bf16", 1.0),
    Ratio("colibri 2 workers", 32, "bf16", 1.2),
    Ratio("colibri 2 workers int8", 8, "q8_0", 1.0), Ratio("colibri 2 workers int8", 32, "q8_0", 1.0),
)
FLEET = "colibri 2 workers"
ORCHESTRATION_MAX = 0.15     # of a one-stream fleet step: schedule, prepare, postprocess, dispatch and combine
READY_MAX_S = 1.0            # `serve` start → its ready line, bench model, bf16, warm page cache


def step_seconds(phases: dict[str, float]) -> float:
    """A fleet's steps in all, from the engine's phase counters (dispatch, wait and compute lie inside forward)."""
    return sum(phases.get(k, 0.0) for k in ("schedule", "prepare", "forward", "postprocess"))


def orchestration(phases: dict[str, float]) -> float | None:
    """The share of a fleet's steps spent orchestrating (the engine's phase counters), None without steps."""
    if (total := step_seconds(phases)) <= 0:
        return None
    return sum(phases.get(k, 0.0) for k in ("schedule", "prepare", "postprocess", "dispatch")) / total


def _row(results: dict, engine: str, streams: int) -> dict | None:
    rows = results.get(engine, {}).get("rows", {})
    return rows.get(streams, rows.get(str(streams)))


def _ratio(got: float, wanted: float) -> str:
    """Two decimals, or three where two would round a miss up to the wanted ratio (1.196x is not 1.20x)."""
    return f"{got:.3f}x" if got < wanted and round(got, 2) >= wanted else f"{got:.2f}x"


def _verdict(ok: bool | None) -> str:
    return "not run" if ok is None else "**met**" if ok else "missed"


def targets_section(llama: dict, results: dict, size: str, dtype: str) -> list[str]:
    """The markdown lines of the targets' table for one run (`llama` as benchmarks.llamacpp.measure gives it, by
    quantization; `results` by engine name, as benchmarks.serving collects them)."""
    rows = []
    for t in RATIOS:
        ours = _row(results, t.engine, t.streams)
        theirs = llama.get(t.peer, {}).get("rows", {}).get(t.streams)
        got = None if ours is None or theirs is None else ours["output_tokens_per_s"] / theirs.output_tokens_per_s
        rows.append([f"{t.engine}, {t.streams} stream{'s' * (t.streams > 1)}", f"≥ {t.wanted:.1f}x llama.cpp "
                     f"{t.peer}", "-" if got is None else _ratio(got, t.wanted), _verdict(None if got is None else
                                                                                        got >= t.wanted)])
    one = _row(results, FLEET, 1)
    share = None if one is None else orchestration(one.get("phases", {}))
    rows.append([f"{FLEET}, orchestration at 1 stream", f"≤ {ORCHESTRATION_MAX:.0%} of a step",
                 "-" if share is None else f"{share:.1%}", _verdict(None if share is None else
                                                                   share <= ORCHESTRATION_MAX)])
    cold = results.get(FLEET, {}).get("cold_start_s")
    rows.append([f"{FLEET}, start → ready", f"≤ {READY_MAX_S:.0f} s", "-" if cold is None else f"{cold:.2f} s",
                 _verdict(None if cold is None else cold <= READY_MAX_S)])
    where = "the bench model in bf16" if size == "bench" and dtype == "bfloat16" else \
        f"the {size} model in {dtype} (the issue sets them on the bench model in bf16; its last target asks that " \
        f"they hold on other sizes too)"
    return ["", "## Against the native-kernels issue's targets", "",
            f"Judged on this run alone, {where}; llama.cpp from the same run.", "",
            table(["target", "wanted", "this run", "verdict"], rows)]

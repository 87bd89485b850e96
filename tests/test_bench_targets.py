"""The serving benchmark's verdict on the native-kernels issue's targets (benchmarks/targets.py): each ratio taken
against llama.cpp's row of the same run, at or above the wanted ratio counted met, a missing engine, stream count
or llama.cpp row "not run", never a verdict from nothing."""

from __future__ import annotations

from benchmarks.llamacpp import Rate
from benchmarks.targets import RATIOS, orchestration, targets_section


def rates(values: tuple[float, float, float]) -> dict:
    return {"rows": {c: Rate(c, v * 1.1, v) for c, v in zip((1, 8, 32), values, strict=True)}}


LLAMA = {"bf16": rates((100.0, 150.0, 250.0)), "q8_0": rates((130.0, 180.0, 240.0))}
ONE_STREAM_PHASES = {"schedule": 0.01, "prepare": 0.02, "forward": 0.94, "postprocess": 0.03, "dispatch": 0.04,
                     "wait": 0.4, "expert_compute": 0.5}     # the step: 1.0 s, of it 0.1 s orchestrating


def results(in_process: tuple[float, float, float], fleet: tuple[float, float, float], int8: tuple[float, float],
            ready_s: float) -> dict:
    def rows(values: tuple[float, ...], streams: tuple[int, ...]) -> dict[str, dict]:
        return {str(c): {"output_tokens_per_s": v, "phases": ONE_STREAM_PHASES} for c, v in zip(streams, values,
                                                                                                strict=True)}
    return {"colibri in-process": {"rows": rows(in_process, (1, 8, 32)), "cold_start_s": 1.3},
            "colibri 2 workers": {"rows": rows(fleet, (1, 8, 32)), "cold_start_s": ready_s},
            "colibri 2 workers int8": {"rows": rows(int8, (8, 32)), "cold_start_s": 1.5}}


def verdicts(lines: list[str]) -> dict[str, tuple[str, str]]:
    """target -> (this run, verdict) from the section's table."""
    out = {}
    for line in "\n".join(lines).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] not in ("target",) and not set(cells[0]) <= {"-"}:
            out[cells[0]] = (cells[2], cells[3])
    return out


def test_each_target_is_judged_against_the_same_runs_llamacpp():
    got = verdicts(targets_section(LLAMA, results((90.0, 179.0, 300.0), (60.0, 150.0, 299.0), (180.0, 239.0), 1.4),
                                   "bench", "bfloat16"))
    assert got["colibri in-process, 1 stream"] == ("0.90x", "**met**")          # exactly the wanted ratio: met
    assert got["colibri in-process, 8 streams"] == ("1.19x", "missed")
    assert got["colibri in-process, 32 streams"] == ("1.20x", "**met**")
    assert got["colibri 2 workers, 1 stream"] == ("0.60x", "**met**")
    assert got["colibri 2 workers, 8 streams"] == ("1.00x", "**met**")
    assert got["colibri 2 workers, 32 streams"] == ("1.196x", "missed")         # not rounded up to the target
    assert got["colibri 2 workers int8, 8 streams"] == ("1.00x", "**met**")     # against q8_0, not bf16
    assert got["colibri 2 workers int8, 32 streams"] == ("0.996x", "missed")    # 239 / 240
    assert got["colibri 2 workers, orchestration at 1 stream"] == ("10.0%", "**met**")
    assert got["colibri 2 workers, start → ready"] == ("1.40 s", "missed")
    assert len(got) == len(RATIOS) + 2


def test_what_the_run_left_out_is_not_run_not_a_verdict():
    res = results((90.0, 200.0, 300.0), (60.0, 150.0, 300.0), (180.0, 240.0), 0.9)
    del res["colibri 2 workers int8"]
    res["colibri in-process"]["rows"].pop("8")
    llama = {"bf16": LLAMA["bf16"]}                                             # no q8_0 row
    got = verdicts(targets_section(llama, res, "small", "bfloat16"))
    assert got["colibri 2 workers int8, 8 streams"] == ("-", "not run")
    assert got["colibri in-process, 8 streams"] == ("-", "not run")
    assert got["colibri 2 workers, start → ready"] == ("0.90 s", "**met**")
    no_fleet = verdicts(targets_section(LLAMA, {"colibri in-process": res["colibri in-process"]}, "bench",
                                        "bfloat16"))
    assert no_fleet["colibri 2 workers, orchestration at 1 stream"] == ("-", "not run")
    assert no_fleet["colibri 2 workers, start → ready"] == ("-", "not run")


def test_orchestration_is_the_engines_own_phases_over_the_step():
    assert orchestration({}) is None
    assert abs(orchestration(ONE_STREAM_PHASES) - 0.10) < 1e-12     # dispatch is inside forward, wait is not counted
    assert orchestration({"forward": 0.5, "dispatch": 0.5}) == 1.0

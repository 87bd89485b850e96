"""benchmarks/common.py ReadProbe: a benchmark row's share of the read rate is taken round by round beside its own
probe, so a row measured while the VM reads slowly is divided by the slow rate, not by one probed a minute before."""

from __future__ import annotations

import time

import pytest

from benchmarks.common import ReadProbe


class Drifting(ReadProbe):
    """A probe whose rate is set by the test (the VM's phase), round by round."""

    def __init__(self, rates: list[float]) -> None:
        super().__init__(nbytes=1 << 20)
        self.rates = iter(rates)

    def gbs(self, min_seconds: float = 0.2) -> float:
        return next(self.rates)


def test_the_share_is_the_median_of_the_rounds_ratios():
    probe = Drifting([10.0, 20.0, 40.0])
    nbytes = 2e6                                          # a call reads 2 MB in ~2 ms: ~1 GB/s
    b = probe.beside(lambda: time.sleep(0.002), nbytes, rounds=3, min_seconds=0.0, min_runs=5)
    assert b.read_gbs == 20.0                             # the probes' median
    assert b.gbs == pytest.approx(nbytes / b.seconds / 1e9)
    assert 0.001 < b.seconds < 0.02
    # each round's ratio is ~gbs / rate; their median is the middle probe's, whatever the order of the rounds
    assert b.share == pytest.approx(b.gbs / 20.0, rel=0.5)
    assert b.share < b.gbs / 10.0 and b.share > b.gbs / 40.0


def test_a_real_probe_reads_a_rate_and_rejects_no_rounds():
    probe = ReadProbe(nbytes=64 << 20)
    assert 0.1 < probe.gbs(min_seconds=0.0) < 10_000
    with pytest.raises(ValueError, match="rounds"):
        probe.beside(lambda: None, 1.0, rounds=0)

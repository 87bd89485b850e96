"""An expert worker's options: one frozen dataclass; `colibri expert` builds its flags from it."""

from __future__ import annotations

from dataclasses import dataclass

from colibri_common.options import ServiceOptions, option
from colibri_common.placement import parse_shard


@dataclass(frozen=True)
class ExpertOptions(ServiceOptions):
    port: int = option(50061, "port; 0 picks a free one")
    shard: str = option("", "I/N: this worker holds shard I of N (0-based)", required=True, metavar="I/N")
    replicas: int = option(1, "every expert lives on this many distinct workers; this worker holds the "
                              "experts of shards I, I-1, … I-R+1 (mod N)")
    metrics_port: int | None = option(None, "serve Prometheus metrics on http://HOST:PORT/metrics (default: off; "
                                            "0 = any free port)")
    max_streams: int = option(16, "concurrent ForwardStream (and Forward) calls at most; beyond it "
                                  "RESOURCE_EXHAUSTED (each router holds one stream per worker)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.replicas <= self.num_shards:
            raise ValueError(f"--replicas {self.replicas}: need 1 <= R <= N (the {self.num_shards} workers)")
        if self.max_streams <= 0:
            raise ValueError(f"--max-streams must be positive, got {self.max_streams}")
        parse_shard(self.shard)      # raises ValueError with a message that says what to fix

    @property
    def shard_index(self) -> int:
        return parse_shard(self.shard)[0]

    @property
    def num_shards(self) -> int:
        return parse_shard(self.shard)[1]

"""An expert worker's options: one frozen dataclass; `colibri expert` builds its flags from it."""

from __future__ import annotations

from dataclasses import dataclass

from colibri_common.options import ServiceOptions, option
from colibri_common.placement import parse_shard


@dataclass(frozen=True)
class ExpertOptions(ServiceOptions):
    port: int = option(50061, "port; 0 picks a free one")
    shard: str = option("", "I/N: this worker holds shard I of N (0-based)", required=True, metavar="I/N")

    def __post_init__(self) -> None:
        super().__post_init__()
        parse_shard(self.shard)      # raises ValueError with a message that says what to fix

    @property
    def shard_index(self) -> int:
        return parse_shard(self.shard)[0]

    @property
    def num_shards(self) -> int:
        return parse_shard(self.shard)[1]

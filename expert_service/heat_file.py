"""A worker's hottest experts, kept across restarts, so a bounded cache starts warm.

On stop, the hot tier's keys (hottest first, per the policy) go to a small JSON file next to the CPU
forms file (`$COLIBRI_CACHE_DIR` or ~/.cache/colibri), named by the checkpoint and the shard; on the next
start the worker packs those (up to its capacity) before it reports ready, and the rest stay mapped. A
file written for another checkpoint (other sizes or dates of its files) or corrupt is ignored and said so.
Plain Python, no torch.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from colibri_common.forms_file import default_path, write_atomic

log = logging.getLogger("colibri.expert")
VERSION = 1
Key = tuple[int, int]


def fingerprint(model_dir: str | Path) -> dict[str, list[int]]:
    """Each safetensors file's size and mtime: a changed checkpoint is another checkpoint."""
    d = Path(model_dir)
    return {p.name: [p.stat().st_size, int(p.stat().st_mtime)] for p in sorted(d.glob("*.safetensors"))}


def heat_path(setting: str, model_dir: str | Path, shard: str, replicas: int) -> Path | None:
    """`--expert-cache-heat`: 'auto' = a file per checkpoint and shard in the cache dir, 'off' = none, else a
    path, made the shard's own (`heat.json` -> `heat.0-of-2.json`, so `serve`'s workers never share one)."""
    if setting == "off":
        return None
    if setting != "auto":
        p = Path(setting)
        return p.with_name(f"{p.stem}.{shard.replace('/', '-of-')}{p.suffix or '.json'}")
    tag = hashlib.sha256(f"{Path(model_dir).resolve()}|{shard}|{replicas}".encode()).hexdigest()[:16]
    return default_path().parent / f"expert-heat-{tag}.json"


def load(path: Path | None, model_dir: str | Path) -> list[Key]:
    if path is None or not path.is_file():
        return []
    try:
        raw = json.loads(path.read_text())
        if raw.get("version") != VERSION or raw.get("checkpoint") != fingerprint(model_dir):
            log.info("%s was written for another checkpoint: starting cold", path)
            return []
        return [(int(a), int(b)) for a, b in raw["hot"]]
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("%s is unreadable (%s): starting cold", path, exc)
        return []


def save(path: Path | None, model_dir: str | Path, hot: list[Key]) -> None:
    """The hot keys into `path`, atomically; a file that cannot be written (a full disk, a read-only directory) is
    a warning (its temp file removed, the file left as it was), and the worker goes on."""
    if path is None or not hot:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({"version": VERSION, "checkpoint": fingerprint(model_dir), "hot": hot}))
    except OSError as exc:
        log.warning("could not write %s (%s); this run's hot experts are not kept", path, exc)

"""The sampling a checkpoint's authors recommend: `generation_config.json`'s temperature, top_p, top_k, min_p,
repetition_penalty and max_new_tokens (as max_tokens) (Qwen3's: temperature 0.6, top_p 0.95, top_k 20).

As vLLM's default `--generation-config auto`, the HTTP front gives them to requests that leave those fields out
(`colibri openai --generation-config vllm`: OpenAI's defaults instead). The router reads them at start and hands
them out in ModelInfo; a value no request could carry is left out, with a warning naming it.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

log = logging.getLogger("colibri")
GENERATION_CONFIG = "generation_config.json"
FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


def _ok(name: str, value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return False
    if name == "temperature":
        return 0 <= value <= 2                 # the range the front takes from a request
    if name == "top_p":
        return 0 < value <= 1
    if name == "top_k":
        return float(value).is_integer() and -1 <= value < 2**31
    if name == "min_p":
        return 0 <= value <= 1
    if name == "max_new_tokens":
        return float(value).is_integer() and 1 <= value < 2**31
    return 0 < value <= 100                    # repetition_penalty


def sampling_defaults(model_dir: str | Path) -> dict[str, float]:
    """The checkpoint's recommended sampling, those of FIELDS it sets ({} without the file)."""
    path = Path(model_dir) / GENERATION_CONFIG
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        log.warning("%s: not read (%s); requests get OpenAI's sampling defaults", path, exc)
        return {}
    if not isinstance(raw, dict):
        return {}
    out: dict[str, float] = {}
    for name in FIELDS:
        if name not in raw or raw[name] is None:
            continue
        if not _ok(name, raw[name]):
            log.warning("%s: %s %r is not a value a request may carry; left out of the sampling defaults",
                        path, name, raw[name])
            continue
        out["max_tokens" if name == "max_new_tokens" else name] = float(raw[name])
    return out

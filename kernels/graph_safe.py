"""Graph-safe mode: while a CUDA graph of a step is captured (and in the eager run that precedes the capture),
the kernels take the forms a graph can hold: no copy back to the host, no host sync, grids sized for the worst
case rather than for the data (kernels/moe_align.py's device alignment; the Triton kernels skip the blocks past
the data). Outside it they take the forms fastest when run op by op (the host alignment: fewer launches).

Per thread: the engine's thread captures while others may run eager work.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class _State(threading.local):
    on = False


_state = _State()


@contextmanager
def graph_safe() -> Iterator[None]:
    """Within: this thread's kernels take their graph-safe forms."""
    was, _state.on = _state.on, True
    try:
        yield
    finally:
        _state.on = was


def graph_safe_active() -> bool:
    return _state.on

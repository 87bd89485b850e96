"""One redundant step of Triton's interpreter skipped, for the suite's speed (the kernels' maths is untouched).

Under TRITON_INTERPRET=1 a launch patches `triton.language` (every builtin rebound to a NumPy version) for
the whole launch. Each call of a nested `@triton.jit` helper inside it patches the language again
(`InterpretedFunction.__call__` -> `_patch_lang`): an `inspect.getmembers` walk of the language, 2-3 ms a
call, which finds the builtins already patched and is never undone. The kernels call helpers in their inner
loops, so that walk was about a fifth of the interpreter's time in `tests/kernels`.

Here a nested call skips the walk when the modules it would patch are those the enclosing launch patched.
The launch's own patch and its restore are Triton's, unchanged; outside a launch nothing is skipped. Installed
only on the pinned Triton whose interpreter has these names; any other version runs as it comes.
"""

from __future__ import annotations

import inspect
import threading

_state = threading.local()


def _langs(fn, tl, core) -> frozenset[int]:
    """The `triton.language` modules visible to `fn`: the ones `_patch_lang(fn)` patches."""
    return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, core))


def install() -> bool:
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    if triton.__version__ != "3.7.1" or not all(hasattr(interpreter, n) for n in
                                                ("_patch_lang", "GridExecutor", "_LangPatchScope")):
        return False
    if getattr(interpreter, "_colibri_patched", False):
        return True
    patch_lang, grid_call = interpreter._patch_lang, interpreter.GridExecutor.__call__

    def launch(self, *args, **kwargs):
        saved = getattr(_state, "depth", 0), getattr(_state, "langs", None)
        _state.depth, _state.langs = saved[0] + 1, None    # langs: set by this launch's own patch, below
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            _state.depth, _state.langs = saved

    def patch(fn):
        langs = _langs(fn, tl, tl.core)
        inside, patched = getattr(_state, "depth", 0) > 0, getattr(_state, "langs", None)
        if inside and patched is not None and langs and langs <= patched:   # none visible: Triton's own error
            return interpreter._LangPatchScope()       # nothing to patch: the launch did; nothing to restore
        scope = patch_lang(fn)
        if inside and patched is None:
            _state.langs = langs                       # the launch's patch: its nested calls may skip theirs
        return scope

    interpreter.GridExecutor.__call__ = launch
    interpreter._patch_lang = patch
    interpreter._colibri_patched = True
    return True

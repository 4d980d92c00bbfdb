"""Triton's interpreter (TRITON_INTERPRET=1, the CPU test path), made to run our kernels.

Importing this module applies the fix below once; every kernel module that loops over runtime
bounds imports it."""
from __future__ import annotations

import os


def _fix_interpreter_index() -> None:
    """Triton 3.6's interpreter turns a scalar into a Python int with int(ndarray of shape (1,)),
    which numpy >= 2.4 refuses (triton-lang/triton#9171), so `range(lo, hi)` with runtime bounds
    fails under TRITON_INTERPRET=1. Re-patch tensor.__index__ to take the single element. Only
    touches the interpreter; compiled kernels are unaffected."""
    try:
        from triton.runtime import interpreter as _interp
    except ImportError:  # pragma: no cover
        return
    orig = getattr(_interp, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_pdserve_fixed", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._pdserve_fixed = True
    _interp._patch_lang_tensor = patched


INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
if INTERPRET:
    _fix_interpreter_index()

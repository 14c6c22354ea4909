"""Triton kernels and their host launchers; imported lazily, only when a Triton path runs."""

from __future__ import annotations

import os

import triton.language as _tl

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    from triton.runtime.interpreter import InterpretedFunction as _Interpreted

    if not isinstance(_tl.standard.sum, _Interpreted):
        # the kernels below would be interpreted but call tl.sum & co. built for the compiler:
        # every launch would fail with "Cannot call @triton.jit'd outside of the scope of a
        # kernel"
        raise RuntimeError(
            "TRITON_INTERPRET=1 was set after triton was imported: its library functions "
            "(tl.sum, ...) were built for the compiler and cannot run under the interpreter. "
            "Set it before anything imports triton (torch._dynamo does, and transformers "
            "imports torch._dynamo), e.g. in the process's environment")

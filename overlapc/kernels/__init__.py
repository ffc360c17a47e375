"""Triton kernels of the fused strategy: AllGather+GEMM and GEMM+ReduceScatter over
symmetric memory (overlapc/runtime/symm.py). One source for CUDA and for the CPU, where
they run under Triton's interpreter (``TRITON_INTERPRET=1``, set here when no CUDA device
exists, before any kernel is defined: Triton reads it when ``@triton.jit`` runs).
"""

from __future__ import annotations

import logging
import os
import re

import torch

log = logging.getLogger("overlapc")

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    os.environ["TRITON_INTERPRET"] = "1"
    log.info("overlapc: no CUDA device; fused kernels run under the Triton interpreter (TRITON_INTERPRET=1)")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _release(version: str) -> tuple[int, ...]:
    """(major, minor) of a version string: "2.4.0rc1" -> (2, 4), "3.6.0+git1234" -> (3, 6)."""
    return tuple(int(re.match(r"\d*", p).group() or 0) for p in version.split("+")[0].split(".")[:2])


def interpreter_problem(triton_version: str | None = None, numpy_version: str | None = None) -> str | None:
    """Why Triton's interpreter cannot run these kernels here (None: it can, or kernels are
    compiled). Triton before 3.7 turns a loop bound held in a kernel argument into a Python
    int with ``int(array)`` on a 1-element array, which NumPy 2.4 refuses
    ("only 0-dimensional arrays can be converted to Python scalars"); Triton 3.7 squeezes first."""
    if triton_version is None or numpy_version is None:
        if not INTERPRET:
            return None
        import numpy
        import triton

        triton_version, numpy_version = triton.__version__, numpy.__version__
    if _release(triton_version) < (3, 7) and _release(numpy_version) >= (2, 4):
        return (
            f"Triton {triton_version}'s interpreter cannot run kernels with loops on NumPy {numpy_version} "
            "(it needs NumPy < 2.4, or Triton >= 3.7)"
        )
    return None


def _interpret_stdlib() -> None:
    """Make Triton's standard-library helpers (``tl.zeros``, ``tl.cdiv``, ...) callable from
    interpreted kernels. They are ``@triton.jit`` functions, and Triton decides at decoration
    time whether one is interpreted: if ``triton.language`` was imported before
    ``TRITON_INTERPRET`` was set (``import torch._dynamo`` imports it), they stay compiled-only
    and raise inside the interpreter. Without a GPU they cannot run compiled anyway."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    for mod in (tl, tl.standard, tl.math):
        for name, obj in list(vars(mod).items()):
            if isinstance(obj, JITFunction):
                setattr(mod, name, InterpretedFunction(obj.fn))


if INTERPRET:
    _interpret_stdlib()


def tl_dtype(dtype: torch.dtype):
    import triton.language as tl

    table = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
    if dtype not in table:
        raise TypeError(f"fused kernels take float32, bfloat16 or float16, got {dtype}")
    return table[dtype]

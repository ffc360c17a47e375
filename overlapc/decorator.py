"""@overlapc.overlap(**options): compile a module class, a module instance or a function.

    @overlapc.overlap(chunks=4)
    class Block(nn.Module): ...          # every instance compiles itself on first call

    block = overlapc.overlap()(block)    # this instance, in place (state_dict keys unchanged)

    @overlapc.overlap
    def step(x, w): ...                  # a compiled function

The decorated object carries ``overlapc_report``: the sites of the graphs it compiled.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .compiler import Backend
from .errors import OverlapError
from .options import Options


def overlap(fn_or_cls=None, /, **options: Any):
    """Decorate with overlapc; usable bare (``@overlap``) or with options (``@overlap(chunks=4)``)."""
    opts = Options.from_user(None, **options)
    if fn_or_cls is not None:
        return _apply(fn_or_cls, opts)
    return lambda target: _apply(target, opts)


def _apply(target, opts: Options):
    if isinstance(target, type):
        if not issubclass(target, torch.nn.Module):
            raise OverlapError(
                f"@overlapc.overlap on class {target.__name__}: only nn.Module subclasses, "
                "nn.Module instances and functions can be decorated"
            )
        return _wrap_class(target, opts)
    if isinstance(target, torch.nn.Module):
        backend = Backend(opts)
        target.compile(backend=backend)
        target.overlapc_report = backend.report
        return target
    if callable(target):
        backend = Backend(opts)
        compiled = torch.compile(target, backend=backend)

        @functools.wraps(target)
        def wrapper(*args, **kwargs):
            return compiled(*args, **kwargs)

        wrapper.overlapc_report = backend.report
        return wrapper
    raise OverlapError(
        f"@overlapc.overlap on a {type(target).__name__}: only nn.Module subclasses, "
        "nn.Module instances and functions can be decorated"
    )


def _wrap_class(cls, opts: Options):
    orig_init = cls.__init__

    @functools.wraps(orig_init)
    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        # nn.Module.compile() is lazy: parallelize_module() may still run after __init__.
        # A subclass of a decorated class compiles once, however deep the super() chain.
        if not getattr(self, "_overlapc_compiled", False):
            backend = Backend(opts)
            self.compile(backend=backend)
            self.overlapc_report = backend.report
            self._overlapc_compiled = True

    cls.__init__ = __init__
    return cls

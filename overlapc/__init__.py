"""overlapc: a compiler for computation-communication overlap in distributed PyTorch.

Three doors, one pipeline behind them::

    torch.compile(model, backend="overlapc", options={"chunks": 4})
    torch.compile(model, backend=overlapc.backend(strategy="decompose"))
    @overlapc.overlap()                      # module class, module instance or function
    overlapc.explain(model, *inputs)         # Report, without running a collective
    overlapc.rewrite(torch.export.export(model, inputs))  # ahead of time: a program to save

See README.md and ../shared/DESIGN.md for how the pieces fit.
"""

from .compiler import Backend, backend, last_report, overlapc_backend, reset_report
from .decorator import overlap
from .errors import OverlapCommError, OverlapError
from .explain import explain
from .export import rewrite
from .options import Options
from .report import Report, Site

__all__ = [
    "Backend",
    "backend",
    "overlap",
    "explain",
    "rewrite",
    "last_report",
    "reset_report",
    "Options",
    "OverlapCommError",
    "OverlapError",
    "Report",
    "Site",
    "overlapc_backend",
]
__version__ = "0.1.0"

"""The one exception users see from overlapc."""


class OverlapError(ValueError):
    """Bad configuration or input, or a run-time failure that names the site it happened at.

    Subclasses ValueError so that callers that already guard configuration errors with
    ``except ValueError`` keep working.
    """


class OverlapCommError(OverlapError, RuntimeError):
    """A collective overlapc emitted failed or timed out; the message names its site.

    Also a RuntimeError, like the transport error it wraps (``__cause__``), so handlers
    written for torch's collective failures (``except RuntimeError``) still catch it."""

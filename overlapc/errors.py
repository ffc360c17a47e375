"""The one exception users see from overlapc."""


class OverlapError(ValueError):
    """Bad configuration or input, or a run-time failure that names the site it happened at.

    Subclasses ValueError so that callers that already guard configuration errors with
    ``except ValueError`` keep working.
    """

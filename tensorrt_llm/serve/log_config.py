"""One log format and level for the server's lines and uvicorn's (error and access loggers).

`configure_logging` puts one handler on the root logger; uvicorn is then run with
`log_config=None`, so its loggers add no handlers of their own and propagate to that one.
"""

from __future__ import annotations

import logging
import sys

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi")


def configure_logging(level: str) -> None:
    """Log at `level` (a logging level name, any case) to stderr in LOG_FORMAT."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric)
    for name in UVICORN_LOGGERS:
        # NOTE: a uvicorn config applied earlier in this process (its default one) leaves
        # handlers and propagate=False behind; undo that so every line takes our format.
        uv = logging.getLogger(name)
        for old in list(uv.handlers):
            uv.removeHandler(old)
        uv.propagate = True
        uv.setLevel(numeric)

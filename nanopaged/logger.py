"""nanopaged's log: the `nanopaged` logger prints INFO lines to stderr, as vLLM's logger does.

Every module logs through `logging.getLogger(__name__)`, a child of this one. The environment
decides: NANOPAGED_LOGGING_LEVEL (default INFO), and NANOPAGED_CONFIGURE_LOGGING=0 leaves the
`nanopaged` logger to the application's own logging setup.
"""
from __future__ import annotations

import logging
import os


def configure_logging() -> None:
    if os.environ.get("NANOPAGED_CONFIGURE_LOGGING", "1") == "0":
        return
    logger = logging.getLogger("nanopaged")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False       # printed once, not again by a root handler
    logger.setLevel(os.environ.get("NANOPAGED_LOGGING_LEVEL", "INFO").upper())

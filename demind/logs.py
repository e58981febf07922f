"""Console logging for the commands: our modules at INFO, third-party chatter at WARNING.

open_clip logs every step of model creation through the root logger at INFO; a user of
``train.py`` wants our progress lines, not those.  Every module logs under its own name
(``logging.getLogger(__name__)``) and all our code, the commands included (``demind.cli``),
lives in the ``demind`` package, so one logger name covers it.
"""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOGGER_NAME = "demind"


def setup_logging(level: int = logging.INFO, packages: tuple[str, ...] = ()) -> None:
    """Configure logging once, for an entry point (never called by the library itself).

    ``packages``: more logger names shown at ``level`` (a package built on demind, such as the toy world)."""
    logging.basicConfig(level=logging.WARNING, format=FORMAT)
    for name in (LOGGER_NAME, *packages):
        logging.getLogger(name).setLevel(level)

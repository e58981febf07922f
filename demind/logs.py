"""Console logging for the entry points: our modules at INFO, third-party chatter at WARNING.

open_clip logs every step of model creation through the root logger at INFO; a user of
``train.py`` wants our progress lines, not those.
"""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: int = logging.INFO) -> None:
    """Configure logging once, for an entry point (never called by the library itself)."""
    logging.basicConfig(level=logging.WARNING, format=FORMAT)
    for name in ("demind", "__main__", "data_gen", "train", "pipelines"):
        logging.getLogger(name).setLevel(level)

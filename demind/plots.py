"""Matplotlib for files: every plot of demind, its benchmarks and the toy world draws through
:func:`file_pyplot`, so a machine without matplotlib (an optional dependency) gets one log line
naming what was not drawn, and no plot ever needs a display."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def file_pyplot(what: str) -> Any | None:
    """``matplotlib.pyplot`` on the file-only Agg backend, or None (logged: "no ``what``: matplotlib is
    not installed") where matplotlib is missing; the caller then returns without a plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("no %s: matplotlib is not installed (pip install matplotlib)", what)
        return None
    return plt

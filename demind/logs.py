"""Console logging for the commands: our modules at INFO, third-party chatter at WARNING.

open_clip logs every step of model creation through the root logger at INFO; a user of
``train.py`` wants our progress lines, not those.  Every module logs under its own name
(``logging.getLogger(__name__)``) and all our code, the commands included (``demind.cli``),
lives in the ``demind`` package, so one logger name covers it.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOGGER_NAME = "demind"


def setup_logging(level: int = logging.INFO, packages: tuple[str, ...] = ()) -> None:
    """Configure logging once, for an entry point (never called by the library itself).

    ``packages``: more logger names shown at ``level`` (a package built on demind, such as the toy world)."""
    logging.basicConfig(level=logging.WARNING, format=FORMAT)
    for name in (LOGGER_NAME, *packages):
        logging.getLogger(name).setLevel(level)


# --------------------------------------------------------------------------- progress


def on_terminal(stream: Any = None) -> bool:
    """True when ``stream`` (default stderr, where bars go) is a terminal: a bar redraws there, but
    written to a log file or a pipe every redraw is another line."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


class ProgressLines:
    """A tqdm stand-in for logs: one readable line at every ``every_percent`` of the total (or every
    ``every_s`` seconds when the total is unknown or the steps are slow), and one when it closes;
    nothing for a loop done in under ``min_s`` seconds (a line per step of a 3-batch loop is noise).
    Offers the part of tqdm's interface the commands use: iteration, ``update``, ``set_postfix``,
    ``write``, ``close``, and use as a context manager."""

    def __init__(self, iterable: Iterable | None = None, total: float | None = None, desc: str = "",
                 unit: str = "it", initial: int = 0, every_percent: float = 10.0, every_s: float = 60.0,
                 min_s: float = 5.0, logger: logging.Logger | None = None, **_: Any) -> None:
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.iterable, self.total, self.desc, self.unit = iterable, total, desc or "progress", unit
        self.n = self.last_n = initial
        self.every_percent, self.every_s, self.min_s = every_percent, every_s, min_s
        self.start = self.last_t = time.monotonic()
        self.postfix = ""
        self.log = logger or logging.getLogger(LOGGER_NAME)
        self.closed = False

    def __iter__(self) -> Iterator:
        for item in self.iterable or ():
            yield item
            self.update(1)
        self.close()

    def __enter__(self) -> "ProgressLines":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _due(self) -> bool:
        now = time.monotonic()
        if now - self.last_t >= self.every_s:
            return True
        if now - self.last_t < self.min_s:
            return False
        return bool(self.total) and (self.n - self.last_n) * 100.0 / self.total >= self.every_percent

    def line(self) -> str:
        """``encode: 1,200/5,000 img (24 %), 35.2 img/s, 34 s elapsed, about 108 s left``."""
        elapsed = max(time.monotonic() - self.start, 1e-9)
        done = f"{self.n:,}" + (f"/{self.total:,} {self.unit} ({100.0 * self.n / self.total:.0f} %)"
                                if self.total else f" {self.unit}")
        rate = self.n / elapsed
        shown = f"{rate:,.1f}" if rate >= 1 else f"{rate:.2g}"  # slow steps: 0.035, not 0.0
        text = f"{self.desc}: {done}, {shown} {self.unit}/s, {elapsed:.0f} s elapsed"
        if self.total and 0 < self.n < self.total and rate > 0:
            text += f", about {(self.total - self.n) / rate:.0f} s left"
        return text + (f" ({self.postfix})" if self.postfix else "")

    def update(self, n: float = 1) -> None:
        self.n += n
        if self._due():
            self.log.info("%s", self.line())
            self.last_n, self.last_t = self.n, time.monotonic()

    def set_postfix(self, ordered_dict: dict | None = None, refresh: bool = True, **kwargs: Any) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in {**(ordered_dict or {}), **kwargs}.items())

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        self.desc = desc or self.desc

    def refresh(self) -> None:
        pass

    @staticmethod
    def write(s: str, file: Any = None, end: str = "\n") -> None:
        print(s, file=file or sys.stdout, end=end, flush=True)

    def close(self) -> None:
        if not self.closed and self.n != self.last_n and time.monotonic() - self.start >= self.min_s:
            self.log.info("%s", self.line())
        self.closed = True


def progress_bar(iterable: Iterable | None = None, *, disable: bool = False, lines: bool = True,
                 **kwargs: Any) -> Any:
    """A tqdm bar on a terminal; off one (a log file, a pipe, CI) :class:`ProgressLines`, a line at
    every 10 % instead of a redraw per step. ``disable``: neither (as tqdm's); ``lines=False``:
    no lines off a terminal either, for a loop that logs its own line every N steps (training).
    The one place the commands decide how progress is shown; every bar is made here."""
    from tqdm.auto import tqdm

    if disable or on_terminal():
        return tqdm(iterable, disable=disable, **kwargs)
    if not lines:
        return tqdm(iterable, disable=True, **kwargs)
    return ProgressLines(iterable, **kwargs)

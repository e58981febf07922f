"""What every command shares: the ``--debug`` flag, logging set-up, and one line per known error.

A known error is bad input that the library has already described (the file, key or shard,
and the fix): printing a traceback under it only hides the message.  Anything else is a bug
and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from collections.abc import Callable

from demind.errors import DemindError
from demind.logs import setup_logging

DEBUG_ENV = "DEMIND_DEBUG"

KNOWN_ERRORS: tuple[type[BaseException], ...] = (
    # Every error the library raises for input a user can fix derives from DemindError (config,
    # checkpoint, shard format/spec, feature cache, resume, non-finite loss/weights, eval layout,
    # image read, caption file, input shard, missing dependency, unwritable or full output).
    DemindError,
    FileNotFoundError, PermissionError,
    # The benchmark readers still report a bad annotation file's line as a plain ValueError with
    # the file and the fix in the message.
    ValueError,
)
"""Errors shown as one line; anything else is a bug and prints its traceback."""


def add_debug_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true",
                        help=f"show the full traceback of an error (or set {DEBUG_ENV}=1)")


def debug_requested(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "debug", False)) or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def run_command(parser: argparse.ArgumentParser, body: Callable[[argparse.Namespace], int],
                argv: list[str] | None = None, *, intermixed: bool = False,
                log_level: int = logging.INFO) -> int:
    """Parse ``argv`` (``--debug`` added), set up logging, run ``body(args)`` -> exit status.

    A known error (:data:`KNOWN_ERRORS`) prints ``error: <message>`` on stderr and returns 2;
    with ``--debug`` or ``DEMIND_DEBUG=1`` its traceback is printed above that line.
    ``intermixed``: positional overrides may come before or after the flags.
    """
    add_debug_option(parser)
    args = parser.parse_intermixed_args(argv) if intermixed else parser.parse_args(argv)
    setup_logging(log_level)
    try:
        return body(args)
    except KNOWN_ERRORS as e:
        if debug_requested(args):
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return 2

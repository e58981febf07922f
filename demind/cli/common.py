"""What every command shares: the config front end, the ``--debug`` flag, logging set-up, one
line per known error, and what a training launcher (``accelerate launch``) states in the environment.

Every command reads one config dataclass through :func:`demind.config.load_config`:
``--config FILE`` plus dotted ``KEY=VALUE`` overrides. :func:`config_parser` builds its parser
from the dataclass, so ``--help`` lists every key with its default and help text, and the short
flags users know (``--checkpoint CKPT``) are declared as :class:`Flag` aliases of keys: a flag
becomes an override, never a second copy of the setting. Old spellings (``--device``,
``--quiet``, ``run.cpu=true``) are refused naming the key that replaced them.

A known error is bad input that the library has already described (the file, key or shard,
and the fix): printing a traceback under it only hides the message.  Anything else is a bug
and keeps its traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import logging
import os
import shutil
import sys
import textwrap
import traceback
import typing
from collections.abc import Callable
from typing import Any, TypeVar

from demind.config import RENAMED_FLAGS, ConfigError, config_keys, load_config
from demind.config_checks import check_command_config
from demind.errors import DemindError
from demind.logs import setup_logging

T = TypeVar("T")

DEBUG_ENV = "DEMIND_DEBUG"
REHASH_ENV = "DEMIND_REHASH"
"""Set (not 0): the stored MLLM answers' digest memo is not trusted, every model file and image is
read again (a file system without change times or inodes: :class:`demind.mllm.DigestMemo`)."""

KNOWN_ERRORS: tuple[type[BaseException], ...] = (
    # Every error the library raises for input a user can fix derives from DemindError (config,
    # checkpoint, shard format/spec, feature cache, resume, non-finite loss/weights, eval layout,
    # image read, caption file, input shard, query file, missing dependency, unwritable or full output).
    DemindError,
    # What the OS says about a path the user named (open() of a missing, unreadable or misplaced
    # file); is_user_error accepts these only when they carry the file name.
    OSError,
)
"""Error types that may be shown as one line (see :func:`is_user_error`). No ValueError, KeyError,
TypeError or RuntimeError: raised by a bug, they keep their traceback."""

USER_OS_ERRNOS = frozenset({errno.ENOENT, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENOTDIR,
                            errno.ELOOP, errno.ENAMETOOLONG, errno.EROFS, errno.ENOSPC, errno.EDQUOT,
                            errno.EFBIG})
"""OSError codes that describe the user's files (missing, unreadable, a folder for a file, a loop)."""


def is_user_error(exc: BaseException) -> bool:
    """True for an error the user can fix from its one-line message: a :class:`DemindError`, or an
    OSError about a named path with one of :data:`USER_OS_ERRNOS`. Anything else is a bug."""
    if isinstance(exc, DemindError):
        return True
    return (isinstance(exc, OSError) and exc.errno in USER_OS_ERRNOS
            and getattr(exc, "filename", None) is not None)


def report_error(exc: BaseException, args: argparse.Namespace) -> int:
    """Print a user error as one ``error:`` line (its traceback above it under --debug) -> 2;
    re-raise anything else so a bug shows its traceback."""
    if not is_user_error(exc):
        raise  # the exception being handled, with its traceback
    if debug_requested(args):
        traceback.print_exception(exc)
    print(f"error: {exc}", file=sys.stderr)
    return 2


def add_debug_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true",
                        help=f"show the full traceback of an error (or set {DEBUG_ENV}=1)")


def debug_requested(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "debug", False)) or os.environ.get(DEBUG_ENV, "") not in ("", "0")


# --------------------------------------------------------------------------- config front end


NO_CONST = object()  # Flag.const when the flag takes a value


@dataclasses.dataclass(frozen=True)
class Flag:
    """A command-line alias of one config key: ``Flag("checkpoint")`` as ``--checkpoint CKPT``.

    ``const``: the value the flag sets when given without one (``--overwrite`` -> true; with
    ``optional_value`` a value may follow, as in ``--quickstart [WORKDIR]``). ``many``: the flag
    takes several values, as a list (``--cirr A.json B.json``)."""

    key: str
    const: Any = NO_CONST
    optional_value: bool = False
    many: bool = False


def _leaf_type(cls: type, key: str) -> Any:
    """The annotated type of dotted ``key`` in ``cls`` (Optional stripped)."""
    tp: Any = cls
    for part in key.split("."):
        tp = typing.get_type_hints(tp)[part]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if args and typing.get_origin(tp) is not list and len(args) == 1:
            tp = args[0]
    return tp


def _format_default(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return '""' if value == "" else str(value)


def config_keys_help(cls: type, columns: int | None = None) -> str:
    """Every config key of ``cls`` with its default and help text, for ``--help``: one line per key
    when it fits ``columns`` (the terminal's width), else the text wrapped beneath its key."""
    rows = config_keys(cls)
    columns = columns or shutil.get_terminal_size((100, 24)).columns
    width = min(max(len(f"{k} = {_format_default(d)}") for k, d, _ in rows), 40)
    lines = ["config keys (KEY=VALUE overrides, or the same nesting in the --config YAML), with defaults:"]
    for key, default, text in rows:
        entry = f"{key} = {_format_default(default)}"
        indent = " " * (4 + width)
        if len(entry) > width:  # a long default: the text starts on the next line
            lines.append(f"  {entry}")
            lines += textwrap.wrap(text, columns - 1, initial_indent=indent, subsequent_indent=indent)
            continue
        wrapped = textwrap.wrap(text, max(columns - 1 - len(indent), 30)) or [""]
        lines.append(f"  {entry:<{width}}  {wrapped[0]}".rstrip())
        lines += [indent + line for line in wrapped[1:]]
    return "\n".join(lines)


def flag_help(key: str, rows: dict[str, tuple[Any, str]]) -> str:
    """A flag's help line: what its key does, then the key and its default (``--help`` lists the key below)."""
    default, text = rows[key]
    where = f"[{key}, default {_format_default(default)}]"
    return f"{text} {where}" if text else where


def config_parser(cls: type, prog: str, description: str, flags: dict[str, Flag] | None = None,
                  *, config_help: str = "YAML file of config keys (defaults: the values listed below)"
                  ) -> argparse.ArgumentParser:
    """The parser of a command whose settings are the dataclass ``cls``: ``--config FILE``,
    ``flags`` (flag name -> :class:`Flag`), dotted overrides; ``--help`` lists every key."""
    p = argparse.ArgumentParser(prog=prog, description=description, epilog=config_keys_help(cls),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", metavar="FILE", help=config_help)
    optional_consts: dict[str, Any] = {}
    rows = {key: (default, text) for key, default, text in config_keys(cls)}
    for name, flag in (flags or {}).items():
        tp = _leaf_type(cls, flag.key)
        kwargs: dict[str, Any] = {"dest": f"flag:{flag.key}", "default": argparse.SUPPRESS,
                                  "help": flag_help(flag.key, rows)}
        metavar = flag.key.rsplit(".", 1)[-1].upper()
        if flag.const is not NO_CONST or tp is bool:
            const = True if flag.const is NO_CONST else flag.const
            if flag.optional_value:
                kwargs.update(nargs="?", const=const, metavar=metavar)
                optional_consts[kwargs["dest"]] = const
            else:
                kwargs.update(action="store_const", const=const)
        else:
            kwargs.update(metavar=metavar, nargs="*" if flag.many else None)
        p.add_argument(name, **kwargs)
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="dotted config overrides, e.g. run.device=cpu (keys below)")
    # what the command loads (tests read it through build_parser()); flags whose value is optional
    p.set_defaults(config_class=cls, optional_consts=optional_consts)
    return p


def refuse_renamed_flags(argv: list[str]) -> None:
    """A flag that became a config key (``--quiet``) is an error naming the key."""
    for token in argv:
        name = token.split("=", 1)[0]
        if name in RENAMED_FLAGS:
            raise ConfigError(f"{name} was replaced by the config key {RENAMED_FLAGS[name]} "
                              f"(a KEY=VALUE override)", key=RENAMED_FLAGS[name].split("=", 1)[0])


def flag_for_key(parser: argparse.ArgumentParser, key: str | None) -> str | None:
    """The flag (``--out``) a :func:`config_parser` gives config key ``key``, or None."""
    for action in parser._actions:  # noqa: SLF001 (argparse keeps its actions there; no public accessor)
        if key is not None and action.dest == f"flag:{key}" and action.option_strings:
            return action.option_strings[0]
    return None


def check_whole_config(cfg: Any, parser: argparse.ArgumentParser) -> None:
    """:func:`demind.config_checks.check_command_config`; its error names the key's flag too, where the
    command has one (the user typed ``--out``, not ``out=``)."""
    try:
        check_command_config(cfg)
    except ConfigError as e:
        flag = flag_for_key(parser, e.key)
        if flag is None:
            raise
        raise ConfigError(f"{e} (given as {flag})", key=e.key) from None


def load_command_config(cls: type[T], args: argparse.Namespace) -> T:
    """The config the parsed ``args`` ask for: defaults < --config file < flags < KEY=VALUE overrides."""
    overrides = list(args.overrides)
    from_flags = []
    for dest, value in vars(args).items():
        if not dest.startswith("flag:"):
            continue
        if dest in getattr(args, "optional_consts", {}) and isinstance(value, str) and "=" in value:
            # `--quickstart run.device=cpu`: argparse gave the override to the flag as its value
            overrides.insert(0, value)
            value = args.optional_consts[dest]
        from_flags.append((dest.split(":", 1)[1], value))
    return load_config(cls, args.config, [*from_flags, *overrides])


# the flags of demind.settings.DistributorOptions (demind-generate, demind-index)
DISTRIBUTOR_FLAGS = {"--distributor": Flag("distributor"), "--workers": Flag("workers"),
                     "--ray-address": Flag("ray_address"), "--shard-attempts": Flag("shard_attempts")}


def apply_rehash_request() -> None:
    """``DEMIND_REHASH=1``: no file's digest is taken from the memo of stored MLLM answers."""
    if os.environ.get(REHASH_ENV, "") not in ("", "0"):
        from demind.mllm import DigestMemo  # only here: most commands never read an MLLM

        DigestMemo.trusted = False


def apply_threads(threads: int) -> None:
    """``run.threads``: torch's CPU threads, set before the command runs its first tensor op (torch
    starts its thread pool then); 0 leaves torch's default."""
    if threads:
        import torch  # only here: --help and config errors need no torch

        torch.set_num_threads(threads)


# --------------------------------------------------------------------------- a training launcher's processes


def launched_processes() -> int:
    """How many processes the launcher (``accelerate launch``, torchrun) started: its ``WORLD_SIZE``,
    1 without one (a GPU launch Accelerate cannot honour is refused by the trainer)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def deepspeed_launch() -> bool:
    """Whether ``accelerate launch`` was given a DeepSpeed config (or ``--use_deepspeed``): it says so
    in ``ACCELERATE_USE_DEEPSPEED``; the trainer then uses DeepSpeed or refuses, never falls back."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def launched_log_level() -> int:
    """Info logs from the main process only (``RANK`` is set by accelerate launch / torchrun)."""
    return logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING


def run_config_command(cls: type[T], parser: argparse.ArgumentParser, body: Callable[[T], int],
                       argv: list[str] | None = None, *, log_level: int = logging.INFO,
                       log_packages: tuple[str, ...] = ()) -> int:
    """Parse ``argv`` with a :func:`config_parser`, load ``cls`` and check it whole (what it writes
    included: :func:`demind.config_checks.check_command_config`), set up logging, run ``body(cfg)``.
    ``log_packages``: loggers besides demind's shown at ``log_level`` (a command of another package).

    A user error (:func:`is_user_error`) prints ``error: <message>`` on stderr and returns 2; with
    ``--debug`` or ``DEMIND_DEBUG=1`` its traceback is printed above that line. Anything else is a bug
    and keeps its traceback."""
    argv = sys.argv[1:] if argv is None else list(argv)
    add_debug_option(parser)
    try:
        refuse_renamed_flags(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # intermixed: overrides may come before or after the flags
    args = parser.parse_intermixed_args(argv)
    setup_logging(log_level, log_packages)
    try:
        cfg = load_command_config(cls, args)
        check_whole_config(cfg, parser)  # what it reads and writes: before the body loads any model
        apply_rehash_request()
        apply_threads(getattr(getattr(cfg, "run", None), "threads", 0))
        return body(cfg)
    except KNOWN_ERRORS as e:
        return report_error(e, args)

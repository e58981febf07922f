"""The one base class of errors a user can fix: bad input, bad config, an unusable output place,
a missing optional dependency.

Every such error in the library derives from :class:`DemindError` (besides the builtin type
it always had, so ``except ValueError`` keeps working), and its message already says what is
wrong, where (file, key, line, tensor, query) and what to do. The command-line wrapper
(``demind/cli/common.py``) prints these as one line and exits 2; anything else is a bug and
keeps its traceback.
"""

from __future__ import annotations


class DemindError(Exception):
    """An error caused by the user's input or environment, with a message that names the fix."""


class InputError(DemindError, ValueError):
    """A file, line, key or value the user gave that cannot be used; the message names it and the fix.

    The generic reader error: a malformed annotation, query, caption or prompt file, or a setting
    outside what a function accepts. ``ValueError`` stays its base so library callers that caught
    it keep working; the command line tells it from a bug's ``ValueError`` by the ``DemindError``."""


class ConfigError(DemindError, ValueError):
    """A config file or override that does not fit the dataclass schema or its rules.

    ``key`` is the dotted key at fault (None when the whole file is at fault)."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


class MissingInputError(DemindError, FileNotFoundError):
    """An input the user named (file, folder, prompt version) that does not exist; the message says what was expected."""


class OutputLocationError(DemindError, OSError):
    """An output folder or file that cannot be written: read-only, no permission, or disk full."""


class NonFiniteError(DemindError, FloatingPointError):
    """A tensor (weights, embeddings, a loss) holds NaN or infinity; the message names it."""


class MissingDependencyError(DemindError, ImportError):
    """An optional dependency the chosen setting needs is not installed; the message says what to install."""


__all__ = ["ConfigError", "DemindError", "InputError", "MissingInputError", "OutputLocationError", "NonFiniteError",
           "MissingDependencyError"]

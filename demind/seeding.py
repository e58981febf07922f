"""Stable seeds from names: the same parts give the same seed in every process and on every machine."""

from __future__ import annotations

import hashlib
from typing import Any


def derive_seed(*parts: Any) -> int:
    """A stable 63-bit seed from any parts, joined by their ``str`` (Python's hash() is salted per process)."""
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1

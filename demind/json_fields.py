"""Checking the fields a reader uses in a JSON annotation file, before it uses them.

Annotation files (COCO, CIRR, FashionIQ, CIRCO) are lists of objects whose fields each reader
indexes directly. A missing field, a null, or a value of another JSON type would otherwise surface
as a ``KeyError`` / ``TypeError`` traceback far from the file, or, for a string id where a number
is expected, silently match nothing. :func:`check_entries` turns each into one :class:`InputError`
naming the file, the entry (``[3]``) and the field.
"""

from __future__ import annotations

import json
from typing import Any

from demind.errors import InputError

JSON_TYPE_NAMES = {int: "an integer", str: "a string", list: "a list", dict: "an object"}


def _describe(value: Any) -> str:
    return json.dumps(value, default=str)[:80]


def field_problem(entry: dict, name: str, kind: type) -> str | None:
    """Why ``entry[name]`` is not a JSON value of ``kind`` (``"missing"``, ``"got null"``, ...), or None.
    ``bool`` is not an integer here (JSON ``true`` where an id belongs is a mistake)."""
    if name not in entry:
        return "missing"
    value = entry[name]
    if isinstance(value, kind) and not isinstance(value, bool):
        return None
    return f"got {_describe(value)}"


def check_object(entry: Any, fields: dict[str, type], where: str) -> dict:
    """``entry`` itself, checked to be a JSON object holding ``fields`` ({name: JSON type});
    else InputError ``"{where} must be an object"`` or ``"{where}.{name} must be a string (missing)"``."""
    if not isinstance(entry, dict):
        raise InputError(f"{where} must be an object, got {_describe(entry)}")
    for name, kind in fields.items():
        problem = field_problem(entry, name, kind)
        if problem:
            raise InputError(f"{where}.{name} must be {JSON_TYPE_NAMES[kind]} ({problem})")
    return entry


def check_entries(entries: Any, fields: dict[str, type], where: str) -> list[dict]:
    """``entries`` itself, checked to be a JSON list of objects each holding ``fields``.

    ``where`` names the list in messages: ``"cap.rc2.val.json"`` gives ``cap.rc2.val.json[3].caption
    must be a string (got null)``; ``"instances.json: annotations"`` gives ``...: annotations[3]...``.
    """
    if not isinstance(entries, list):
        raise InputError(f"{where} must be a list of objects, got a JSON {_json_type(entries)}")
    for i, entry in enumerate(entries):
        check_object(entry, fields, f"{where}[{i}]")
    return entries


def check_string_map(data: Any, where: str) -> dict[str, str]:
    """``data`` checked to be a JSON object whose values are strings (a name -> path table)."""
    if not isinstance(data, dict):
        raise InputError(f"{where} must be an object of name -> path strings, got a JSON {_json_type(data)}")
    bad = next((k for k, v in data.items() if not isinstance(v, str)), None)
    if bad is not None:
        raise InputError(f"{where}: the value of {bad!r} must be a string (got {_describe(data[bad])})")
    return data


def check_unique_ids(entries: Any, where: str, what: str = "query") -> None:
    """Refuse two entries of one file under one id with different content (``entries``: (id,
    content) pairs, content comparable with ``==``): results are keyed by id, so one of them would be
    scored against the other's answers. Entries repeated exactly are left as they are."""
    seen: dict[str, Any] = {}
    for key, content in entries:
        key = str(key)
        if key in seen and seen[key] != content:
            raise InputError(f"{where}: {what} id {key!r} is used by two {what} entries with different content; "
                             f"give each its own id (or delete one)")
        seen.setdefault(key, content)


def _json_type(value: Any) -> str:
    """A parsed JSON value's type in words (``object``, ``list``, ``string``, ``number``, ...)."""
    return {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")

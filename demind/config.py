"""Config as nested dataclasses: defaults in code, YAML files, dotted overrides, one validation pass.

    cfg = load_config(TrainConfig, "configs/train/smoke.yaml", ["optim.lr=3e-5"])

An unknown key anywhere (file or override) raises :class:`ConfigError` naming the
key and the nearest valid ones, so a typo never silently falls back to a default.

Values are checked once, at load time, against the field types without silent coercion
(``1.5`` or ``true`` for an int is an error; an int for a float is fine) and against the
rules declared on the fields themselves::

    lr: float = setting(1e-6, gt=0)
    schedule: str = setting("cosine", choices=("cosine", "constant"))

A dataclass may add checks that involve several fields with a ``config_problems()`` method
returning ``[(key, message), ...]``. Every error names the key, the value, where the value
came from (the file or the command line) and what is allowed.

A command then checks what it will write, before its body runs: :mod:`demind.config_checks`
(:func:`~demind.config_checks.check_command_config`), the one place its whole config is checked.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from demind.config_checks import check_output_key  # noqa: F401 -- the commands' import
from demind.errors import ConfigError
from demind.io import write_text_atomic
from demind.settings import Rule

T = TypeVar("T")

COMMAND_LINE = "command line"


# --------------------------------------------------------------------------- old spellings

RENAMED_KEYS: dict[str, str] = {
    # old dotted key -> what to write instead
    "run.cpu": "run.device (run.device=cpu)",
    "engine.device": "run.device",
    "sampling.seed": "run.seed",
    "progress": "run.progress",
    "device": "run.device",
    "precision": "backbone.precision",
}
"""Keys that were renamed: in a file or an override they are refused with one message naming the new key."""

RENAMED_FLAGS: dict[str, str] = {
    "--device": "run.device=cpu|cuda|cuda:N",
    "--quiet": "run.progress=false",
    "--no-progress": "run.progress=false",
}
"""Command-line flags that became config keys (checked by the commands, :mod:`demind.cli.common`)."""


REMOVED_KEYS: dict[str, str] = {
    # dotted key of a deleted setting -> what to do instead
    "world": "the toy world has one version now (World v2.1): remove the key",
    "backbone.world": "the toy world has one version now (World v2.1): remove the key",
    "engine.prefix_cache_tokens": "the prefix store is sized in bytes: engine.prefix_store_bytes "
                                  "(0 = a share, engine.prefix_store_fraction, of the free device memory)",
}
"""Keys of settings that were deleted: refused with one message saying what to do instead."""


def renamed_key_error(key: str) -> ConfigError | None:
    """The error for an old spelling or a deleted setting ``key`` (dotted), or None when it is neither."""
    new = RENAMED_KEYS.get(key)
    if new is not None:
        return ConfigError(f"config key {key!r} was renamed: use {new}", key=key)
    if key in REMOVED_KEYS:
        return ConfigError(f"config key {key!r} was removed: {REMOVED_KEYS[key]}", key=key)
    return None


# --------------------------------------------------------------------------- types


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _unknown_key_error(key: str, valid: list[str], where: str) -> ConfigError:
    renamed = renamed_key_error(where + key)
    if renamed is not None:
        return renamed
    near = difflib.get_close_matches(key, valid, n=3, cutoff=0.4)
    hint = f"; did you mean {', '.join(repr(n) for n in near)}?" if near else ""
    return ConfigError(
        f"unknown config key {where + key!r}{hint} (valid keys here: {', '.join(sorted(valid))})", key=where + key
    )


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    """Optional[X] -> (X, True); other types -> (type, False)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return rest[0], len(rest) < len(args)
    return tp, tp is Any


def _bad_type(where: str, value: Any, expected: str) -> ConfigError:
    return ConfigError(f"config key {where!r} must be {expected}, got {value!r}", key=where)


def _as_int(value: Any, where: str) -> int:
    """An int, or an integral float / numeric string ('1e4' is YAML's string for 10000); 1.5 and true are errors."""
    if isinstance(value, bool):
        raise _bad_type(where, value, "an integer")
    if isinstance(value, int):
        return value
    number = value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            try:
                number = float(value)
            except ValueError:
                raise _bad_type(where, value, "an integer") from None
    if isinstance(number, float) and math.isfinite(number) and number.is_integer():
        return int(number)
    raise _bad_type(where, value, "an integer")


def _as_float(value: Any, where: str) -> float:
    if isinstance(value, bool):
        raise _bad_type(where, value, "a number")
    try:
        number = float(value) if isinstance(value, (int, float, str)) else math.nan
    except ValueError:
        number = None
    if number is None or not math.isfinite(number):
        raise _bad_type(where, value, "a finite number")
    return number


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check a YAML/CLI value against the annotated type; errors name the key. Never coerces silently."""
    tp, optional = _strip_optional(tp)
    if value is None:
        if optional:
            return None
        raise _bad_type(where, value, f"set (null is not allowed here; a {getattr(tp, '__name__', tp)})")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise _bad_type(where, value, "a mapping")
        return from_dict(tp, value, prefix=where + ".")
    origin = typing.get_origin(tp)
    if origin in (list, tuple):
        if isinstance(value, str):
            value = yaml.safe_load(value) if value.strip().startswith("[") else [
                v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise _bad_type(where, value, "a list")
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise _bad_type(where, value, f"a list of {len(args)} values")
            return tuple(_coerce(v, a, where) for v, a in zip(value, args))
        item_tp = args[0] if args else Any
        items = [_coerce(v, item_tp, where) for v in value]
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise _bad_type(where, value, "a mapping")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no"):
            return value.lower() in ("true", "yes")
        raise _bad_type(where, value, "true or false")
    if tp is int:
        return _as_int(value, where)
    if tp is float:
        return _as_float(value, where)
    if tp is str:
        if isinstance(value, (dict, list, tuple)):
            raise _bad_type(where, value, "a string")
        return str(value)
    return value


def from_dict(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    """Build dataclass ``cls`` from a (nested) dict; unknown keys and wrong types are errors."""
    types_ = _field_types(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in types_:
            raise _unknown_key_error(key, list(types_), prefix)
        kwargs[key] = _coerce(value, types_[key], prefix + key)
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:  # a section's own __post_init__ check
        if isinstance(e, ConfigError) and prefix and e.key and not e.key.startswith(prefix):
            # the section checked itself (validate in __post_init__): name the key as the file does
            raise ConfigError(str(e).replace(repr(e.key), repr(prefix + e.key)), key=prefix + e.key) from None
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(str(e), key=prefix.rstrip(".") or None) from None  # its message names the key


# --------------------------------------------------------------------------- validation


def config_problems(cfg: Any, prefix: str = "") -> list[tuple[str, str]]:
    """(dotted key, message) for every value of ``cfg`` that breaks a declared rule or a
    section's ``config_problems()`` cross-field check, nested sections included."""
    problems: list[tuple[str, str]] = []
    for f in dataclasses.fields(cfg):
        key, value = prefix + f.name, getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            problems += config_problems(value, key + ".")
            continue
        rule: Rule | None = f.metadata.get("rule")
        if rule is not None and not rule.allows(value):
            problems.append((key, f"config key {key!r} = {value!r} must be {rule.describe()}"))
    own = getattr(cfg, "config_problems", None)
    if callable(own):
        problems += [(prefix + key, f"config key {prefix + key!r}{' ' if msg.startswith('=') else ': '}{msg}")
                     for key, msg in own()]
    return problems


def validate(cfg: Any, origin: Any = None) -> None:
    """Raise one ConfigError listing every problem of ``cfg``; ``origin(key)`` says where a key's value came from."""
    problems = config_problems(cfg)
    if problems:
        lines = [msg + (f" ({origin(key)})" if origin else "") for key, msg in problems]
        raise ConfigError("invalid config: " + "; ".join(lines), key=problems[0][0])


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict (tuples become lists), ready for YAML/JSON."""
    def convert(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return {f.name: convert(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [convert(x) for x in v]
        if isinstance(v, dict):
            return {k: convert(x) for k, x in v.items()}
        return v
    return convert(cfg)


def with_defaults(saved: Any, defaults: Any) -> Any:
    """``saved`` (a :func:`to_dict` of an older run) with the keys it lacks taken from ``defaults``
    (nested mappings merged): a key added since, left at its default, is no change."""
    if not (isinstance(saved, dict) and isinstance(defaults, dict)):
        return saved
    return {**defaults, **{k: with_defaults(v, defaults.get(k)) for k, v in saved.items()}}


def config_changes(old: Any, new: Any, prefix: str = "") -> list[str]:
    """``"key (old -> new)"`` for every dotted key whose value differs between two :func:`to_dict`
    configs (or sections of them, named by ``prefix``): what a resumed run names when it refuses
    another recipe (demind-train, demind-train-triplets)."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [d for k in sorted(set(old) | set(new))
                for d in config_changes(old.get(k), new.get(k), f"{prefix}.{k}" if prefix else str(k))]
    return [] if old == new else [f"{prefix} ({old!r} -> {new!r})"]


def config_keys(cls: type, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(dotted key, default, help text) of every leaf field of ``cls``, nested sections flattened,
    for ``--help``. The help text is the field's ``setting(help=...)``, else its declared rule."""
    rows: list[tuple[str, Any, str]] = []
    defaults = cls()
    types_ = _field_types(cls)
    for f in dataclasses.fields(cls):
        key, default = prefix + f.name, getattr(defaults, f.name)
        tp, _ = _strip_optional(types_[f.name])
        if dataclasses.is_dataclass(tp):
            rows += config_keys(tp, key + ".")
            continue
        rule: Rule | None = f.metadata.get("rule")
        text = f.metadata.get("help") or ""
        if rule is not None and rule != Rule() and rule.describe() not in text:
            text = (text + "; " if text else "") + rule.describe()
        rows.append((key, to_dict(default) if isinstance(default, (list, tuple, dict)) else default, text))
    return rows


# --------------------------------------------------------------------------- loading


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"optim.lr=3e-5"`` -> (["optim", "lr"], 3e-5); the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    key, raw = text.split("=", 1)
    if not key.strip():
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw  # e.g. "a: b" in a free-text value: keep the text, the type check decides
    return key.strip().split("."), value


def _set_dotted(data: dict[str, Any], cls: type, keys: list[str], value: Any, raw: str, prefix: str = "") -> None:
    """Write ``value`` at ``keys`` inside ``data``, validating each level against ``cls``.

    A string field gets the override's text as written (YAML would turn ``no`` into false)."""
    types_ = _field_types(cls)
    head, rest = keys[0], keys[1:]
    if head not in types_:
        raise _unknown_key_error(head, list(types_), prefix)
    tp, optional = _strip_optional(types_[head])
    if not rest:
        # YAML reads `no` as false, `1e-5` as a string and `a: b` as a mapping: a string field takes the text
        keep_text = tp is str and value is not None and not isinstance(value, str)
        data[head] = raw.strip() if keep_text else value
        return
    if not dataclasses.is_dataclass(tp):
        raise ConfigError(f"config key {prefix + head!r} is not a section, so {prefix + '.'.join(keys)!r} is not a key",
                          key=prefix + ".".join(keys))
    section = data.setdefault(head, {})
    if not isinstance(section, dict):
        section = data[head] = {}
    _set_dotted(section, tp, rest, value, raw, prefix + head + ".")


def _has_key(data: Any, key: str) -> bool:
    for part in key.split("."):
        if not isinstance(data, dict) or part not in data:
            return False
        data = data[part]
    return True


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader that refuses a mapping repeating a key (PyYAML keeps the last value
    silently: a config edited twice would run with whichever copy came later)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<: *anchor``: merged keys may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, typing.Hashable) and key in seen:
                raise ConfigError(f"key {key!r} appears twice (lines {seen[key]} and {line}); keep one of them",
                                  key=str(key))
            if isinstance(key, typing.Hashable):
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def read_yaml_file(path: str | Path, what: str = "config file") -> Any:
    """Parse a YAML file a user wrote: not UTF-8, not YAML or a repeated key is a ConfigError
    naming the file (and the key and lines) and the fix; OSError of opening it is the caller's."""
    path = Path(path)
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} {path} is not UTF-8 text (byte {e.start}: {data[e.start:e.start + 1]!r}); "
                          "save it as UTF-8 (your editor's encoding setting) and run again") from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 -- a SafeLoader subclass
    except ConfigError as e:
        raise ConfigError(f"{what} {path}: {e}", key=e.key) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} {path} is not valid YAML: {e}") from None


def load_config(cls: type[T], path: str | Path | None = None,
                overrides: list[str | tuple[str, Any]] | None = None) -> T:
    """Defaults of ``cls``, updated by the YAML file at ``path``, then by dotted ``overrides``;
    then every value is checked (types, declared rules, cross-field checks).

    An override is ``"optim.lr=3e-5"`` (the value read as YAML) or a ``("optim.lr", value)`` pair
    whose value is taken as given (a command's flag such as ``--text "red # blue"``)."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} " + ("is a folder; give the YAML file" if path.is_dir()
                                                          else "does not exist"))
        loaded = read_yaml_file(path, "config file") or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        data = loaded
    file_data = yaml.safe_load(yaml.safe_dump(data)) if data else {}  # a copy: overrides must not show as file keys
    from_command_line: set[str] = set()

    def origin(key: str | None) -> str:
        if key is None:
            return f"in {path}" if path is not None else "defaults"
        if any(key == k or key.startswith(k + ".") or k.startswith(key + ".") for k in from_command_line):
            return COMMAND_LINE
        if path is not None and _has_key(file_data, key):
            return f"in {path}"
        return "default value"

    for text in overrides or []:
        if isinstance(text, tuple):
            keys, value = text[0].split("."), text[1]
            raw, text = str(value), f"{text[0]}={value}"
        else:
            keys, value = parse_override(text)
            raw = text.split("=", 1)[1]
        try:
            _set_dotted(data, cls, keys, value, raw)
        except ConfigError as e:
            raise ConfigError(f"{e} ({COMMAND_LINE}: {text!r})", key=e.key) from None
        from_command_line.add(".".join(keys))
    try:
        cfg = from_dict(cls, data)
    except ConfigError as e:
        raise ConfigError(f"{e} ({origin(e.key)})", key=e.key) from None
    validate(cfg, origin)
    return cfg


def save_config(cfg: Any, path: str | Path) -> None:
    """Write the resolved config as YAML, atomically."""
    write_text_atomic(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))

"""Config as nested dataclasses: defaults in code, YAML files, dotted overrides.

    cfg = load_config(TrainConfig, "configs/train/smoke.yaml", ["optim.lr=3e-5"])

An unknown key anywhere (file or override) raises :class:`ConfigError` naming the
key and the nearest valid ones, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from demind.io import write_text_atomic

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or override that does not fit the dataclass schema."""


class MissingDependencyError(ImportError):
    """An optional dependency the chosen setting needs is not installed; the message says what to install."""


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _unknown_key_error(key: str, valid: list[str], where: str) -> ConfigError:
    near = difflib.get_close_matches(key, valid, n=3, cutoff=0.4)
    hint = f"; did you mean {', '.join(repr(n) for n in near)}?" if near else ""
    return ConfigError(
        f"unknown config key {where + key!r}{hint} (valid keys here: {', '.join(sorted(valid))})"
    )


def _strip_optional(tp: Any) -> Any:
    """Optional[X] -> X; other unions are returned unchanged."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Turn a YAML/CLI value into the annotated type, with errors naming the key."""
    if value is None:
        return None
    tp = _strip_optional(tp)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"config key {where!r} must be a mapping, got {value!r}")
        return from_dict(tp, value, prefix=where + ".")
    origin = typing.get_origin(tp)
    if origin in (list, tuple):
        if isinstance(value, str):
            value = yaml.safe_load(value) if value.strip().startswith("[") else [
                v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key {where!r} must be a list, got {value!r}")
        args = typing.get_args(tp)
        item_tp = args[0] if args else Any
        items = [_coerce(v, item_tp, where) for v in value]
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key {where!r} must be a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"config key {where!r} must be true or false, got {value!r}")
    if tp in (int, float):
        try:
            number = float(value) if tp is float else int(value)
        except (TypeError, ValueError):
            kind = "an integer" if tp is int else "a number"
            raise ConfigError(f"config key {where!r} must be {kind}, got {value!r}") from None
        return number
    if tp is str:
        return str(value)
    return value


def from_dict(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    """Build dataclass ``cls`` from a (nested) dict; unknown keys are errors."""
    types_ = _field_types(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in types_:
            raise _unknown_key_error(key, list(types_), prefix)
        kwargs[key] = _coerce(value, types_[key], prefix + key)
    return cls(**kwargs)


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


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"optim.lr=3e-5"`` -> (["optim", "lr"], 3e-5); the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    key, raw = text.split("=", 1)
    if not key.strip():
        raise ConfigError(f"override {text!r} has an empty key")
    value = yaml.safe_load(raw) if raw.strip() else ""
    return key.strip().split("."), value


def _set_dotted(data: dict[str, Any], cls: type, keys: list[str], value: Any) -> None:
    """Write ``value`` at ``keys`` inside ``data``, validating each level against ``cls``."""
    types_ = _field_types(cls)
    head, rest = keys[0], keys[1:]
    if head not in types_:
        raise _unknown_key_error(head, list(types_), "")
    if not rest:
        data[head] = value
        return
    sub_tp = _strip_optional(types_[head])
    if not dataclasses.is_dataclass(sub_tp):
        raise ConfigError(f"config key {head!r} is not a section, so {'.'.join(keys)!r} is not a key")
    try:
        _set_dotted(data.setdefault(head, {}), sub_tp, rest, value)
    except ConfigError as e:
        raise ConfigError(str(e).replace("config key '", f"config key '{head}.", 1)) from None


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """Defaults of ``cls``, updated by the YAML file at ``path``, then by dotted ``overrides``."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        data = loaded
    for text in overrides or []:
        keys, value = parse_override(text)
        _set_dotted(data, cls, keys, value)
    try:
        return from_dict(cls, data)
    except ConfigError as e:
        where = f" (in {path})" if path is not None else ""
        raise ConfigError(f"{e}{where}") from None


def save_config(cfg: Any, path: str | Path) -> None:
    """Write the resolved config as YAML, atomically."""
    write_text_atomic(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))

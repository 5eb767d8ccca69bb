"""Reading a config: defaults ← a YAML file (strict: duplicate keys refused) ← `--set` overrides.

Parsing and value checks only (no torch, no devices, no data files): the checks against the
machine are `hsdp.run.preflight`, and `hsdp.run.preflight.load_checked_config` runs both.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import yaml

from hsdp.config.schema import Config, ConfigError, to_dict
from hsdp.config.validate import validate


def _type_name(tp: Any) -> str:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if args:
        return f"{args[0].__name__} or null"
    return tp.__name__


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Convert a YAML/CLI value to the field's annotated type, or raise ConfigError."""
    optional = type(None) in typing.get_args(tp)
    if optional:
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none", "~")):
            return None
        tp = [a for a in typing.get_args(tp) if a is not type(None)][0]
    expected = f"expected {_type_name(tp)}{' or null' if optional and 'null' not in _type_name(tp) else ''}"
    bad = ConfigError(f"{key}: {expected}, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise bad
    if tp is int:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                raise bad from None
        raise bad
    if tp is float:
        if isinstance(value, bool):
            raise bad
        try:
            number = float(value) if isinstance(value, (int, float, str)) else None
        except ValueError:
            number = None
        if number is None or not math.isfinite(number):
            raise ConfigError(f"{key}: expected a finite float, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)  # --set text arrives verbatim, so "2024-01-01" or "010" stay as typed
        raise bad
    raise bad


def _section_fields(section_obj: Any) -> dict[str, Any]:
    hints = typing.get_type_hints(type(section_obj))
    return {f.name: hints[f.name] for f in dataclasses.fields(section_obj)}


def _set_value(cfg: Config, key: str, value: Any) -> None:
    parts = key.split(".")
    sections = [f.name for f in dataclasses.fields(cfg)]
    if len(parts) != 2:
        raise ConfigError(f"{key}: expected a key of the form section.key (sections: {', '.join(sections)})")
    section, name = parts
    if section not in sections:
        raise ConfigError(f"{key}: unknown section {section!r} (expected one of: {', '.join(sections)})")
    obj = getattr(cfg, section)
    fields_ = _section_fields(obj)
    if name not in fields_:
        raise ConfigError(f"{key}: unknown key in section {section!r} (expected one of: {', '.join(fields_)})")
    setattr(obj, name, _coerce(key, value, fields_[name]))


def _apply_mapping(cfg: Config, data: Any, origin: str) -> list[str]:
    """Set each `section.key` of `data`; the keys set."""
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: expected a mapping of sections, got {type(data).__name__}")
    keys = []
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{section}: expected a mapping of keys, got {values!r}")
        for name, value in values.items():
            _set_value(cfg, f"{section}.{name}", value)
            keys.append(f"{section}.{name}")
    return keys


def parse_override(text: str) -> tuple[str, str]:
    """`section.key=value` → (key, raw text); the field's type decides how the text is read."""
    if "=" not in text:
        raise ConfigError(f"--set {text}: expected section.key=value")
    key, raw = text.split("=", 1)
    return key.strip(), raw


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key repeated in one mapping (plain YAML silently keeps the last)."""

    def compose_document(self) -> Optional[yaml.Node]:
        self._root = super().compose_document()
        return self._root

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<:` merges may be overridden by explicit keys, as YAML intends
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                where = ".".join(map(str, [*(_key_path(self._root, node) or []), key]))
                raise _DuplicateKey(
                    f"duplicate key {where} at {_position(key_node.start_mark)} "
                    f"(first at {_position(seen[key].start_mark)})"
                )
            seen[key] = key_node
        return super().construct_mapping(node, deep)


class _DuplicateKey(Exception):
    """A YAML mapping repeats a key (raised by the strict loader, turned into a ConfigError)."""


def _position(mark: yaml.Mark) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}"


def _key_path(root: Optional[yaml.Node], target: yaml.Node) -> Optional[list[str]]:
    """Keys leading from the document root to the mapping node `target` (for error messages)."""
    if root is target:
        return []
    if isinstance(root, yaml.MappingNode):
        children = [(k.value, v) for k, v in root.value]
    elif isinstance(root, yaml.SequenceNode):
        children = [(str(i), v) for i, v in enumerate(root.value)]
    else:
        return None
    for name, child in children:
        below = _key_path(child, target)
        if below is not None:
            return [name, *below]
    return None


def read_yaml(path: str, key: str = "--config", expected: str = "a mapping of sections") -> Any:
    """Parse a YAML file strictly; ConfigError (naming `key`, the file, line and column) on any problem.

    An empty file (or one holding only comments) is an error: it is almost always a mistake.
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"{key}: file not found: {path}")
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{key}: cannot read {path} ({e})") from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)
    except _DuplicateKey as e:
        raise ConfigError(f"{key}: {path}: {e}") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{_position(mark)}: " if mark else ""
        what = f"{e.problem or 'syntax error'}{f' ({e.context})' if e.context else ''}"
        raise ConfigError(f"{key}: {path} is not valid YAML ({where}{' '.join(what.split())})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{key}: {path} is not valid YAML ({' '.join(str(e).split())})") from None
    if data is None:
        raise ConfigError(f"{key}: {path} is empty (expected {expected})")
    return data


def load_config(path: Optional[str], overrides: Sequence[str] = ()) -> Config:
    """Defaults ← YAML file ← `--set` overrides, then `validate` (the values; not the machine: see
    `hsdp.run.preflight.load_checked_config`)."""
    cfg = Config()
    given = _apply_mapping(cfg, read_yaml(path), str(path)) if path is not None else []
    for text in overrides:
        key, value = parse_override(text)
        _set_value(cfg, key, value)
        given.append(key)
    if "model.bias" not in given:  # unset: the arch's default (llama has none)
        cfg.model.bias = cfg.model.arch != "llama"
    validate(cfg)
    return cfg


def save_config(cfg: Config, path: Path) -> None:
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def from_dict(data: dict[str, Any]) -> Config:
    """A Config from a saved mapping (a run folder's or checkpoint's config.yaml); not validated."""
    cfg = Config()
    _apply_mapping(cfg, data, "config")
    return cfg

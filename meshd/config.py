"""meshd's one config loader: typed settings from a YAML file, then environment
variables, then command-line overrides, validated once at start.

Every limit is a named setting with a default. A bad value fails start-up with
a message that names the key (`pools[0].endpoints[1].url: ...`) and the reason.

The settings tree is meshd/config_schema.py, the commented example meshd/config_example.py;
this module loads and validates, and is where the rest of meshd imports both from.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from meshd.config_example import EXAMPLE
from meshd.config_schema import ADMISSION_SLOTS_PER_ENDPOINT, Config, Routing

ENV_PREFIX = "MESHD_"
ENV_NESTING = "__"


class ConfigError(ValueError):
    """The configuration is invalid; `problems` holds one line per bad key."""

    def __init__(self, problems: list[str], source: str = "config") -> None:
        self.problems = problems
        self.source = source
        super().__init__(f"{source}: " + "; ".join(problems))

    def render(self) -> str:
        lines = [f"invalid configuration ({self.source}):"]
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)


def _loc(loc: Iterable[int | str]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("function-after", "function-before") or part.startswith("function-"):
            continue
        else:
            out += f".{part}" if out else str(part)
    return out


def _problems(exc: ValidationError, origins: Mapping[str, str] | None = None) -> list[str]:
    """One line per bad key, naming where a value came from when it was not the file (an
    environment variable, a --set). A collection left too short only because one of its
    items failed is not a second problem: the item's error says it."""
    errors = exc.errors()
    locs = [tuple(err["loc"]) for err in errors]
    problems = []
    for err, loc in zip(errors, locs, strict=True):
        if err["type"] == "too_short" and any(o[: len(loc)] == loc and o != loc for o in locs):
            continue
        where = _loc(loc)
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling; `meshd config example` lists every key)"
        origin = next(
            (o for k, o in (origins or {}).items() if where == k or where.startswith(k + ".")),
            None,
        )
        if origin is not None:
            msg += f" (from {origin})"
        problems.append(f"{where}: {msg}" if where else msg)
    return problems


def _set_path(tree: dict[str, Any], path: list[str], value: Any, source: str) -> None:
    node = tree
    for i, key in enumerate(path[:-1]):
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            where = ".".join(path[: i + 1])
            raise ConfigError([f"{where}: cannot set a sub-key of a non-mapping"], source)
        node = child
    node[path[-1]] = value


def _parse_scalar(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def env_overrides(env: Mapping[str, str]) -> list[tuple[list[str], Any, str]]:
    """MESHD_LISTENERS__OUTBOUND__PORT=15001 -> (["listeners","outbound","port"], 15001)."""
    out = []
    for name, raw in sorted(env.items()):
        if not name.startswith(ENV_PREFIX) or name == "MESHD_CONFIG":
            continue
        rest = name[len(ENV_PREFIX) :]
        if ENV_NESTING not in rest and rest.upper() != "LOG_LEVEL":
            continue  # MESHD_PURE_PYTHON and other switches are not config keys
        path = [p.lower() for p in rest.split(ENV_NESTING)]
        out.append((path, _parse_scalar(raw), f"environment variable {name}"))
    return out


def load_config(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Iterable[str] = (),
    base: Mapping[str, Any] | None = None,
) -> Config:
    """Defaults < `base` < YAML file < MESHD_* environment < `key.path=value` overrides."""
    env = os.environ if env is None else env
    tree: dict[str, Any] = dict(base or {})
    source = "defaults"
    path = path or env.get("MESHD_CONFIG")
    if path:
        source = str(path)
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError([f"cannot read config file: {exc.strerror}"], source) from None
        except UnicodeDecodeError as exc:
            raise ConfigError(
                [f"not UTF-8 text (byte {exc.start}: {exc.reason})"], source
            ) from None
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError([f"not valid YAML: {exc}"], source) from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(["the top level must be a mapping of keys"], source)
        tree = deep_merge(tree, loaded)
    origins: dict[str, str] = {}  # a key set after the file -> what set it
    for keys, value, origin in env_overrides(env):
        _set_path(tree, keys, value, origin)
        origins[".".join(keys)] = origin
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError([f"override {item!r}: expected KEY.PATH=VALUE"], "--set")
        _set_path(tree, key.split("."), _parse_scalar(raw), f"--set {key}")
        origins[key] = f"--set {item}"
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_problems(exc, origins), source) from None


def deep_merge(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """`b` merged into `a`, mappings key by key (neither is changed)."""
    out = dict(a)
    for k, v in b.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


__all__ = [
    "ADMISSION_SLOTS_PER_ENDPOINT",
    "ENV_NESTING",
    "ENV_PREFIX",
    "EXAMPLE",
    "Config",
    "ConfigError",
    "Routing",
    "deep_merge",
    "env_overrides",
    "load_config",
]

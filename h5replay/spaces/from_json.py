"""A space back from its JSON description (`Space.to_json()`), checked before anything is built."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from h5replay.errors import ConfigError
from h5replay.spaces.base import _MAX_DIMS, MAX_DEPTH, DictSpace, Space
from h5replay.spaces.leaves import BinarySpace, BoxSpace, TextSpace

__all__ = ["space_from_json"]


def _bound_from_json(obj: Any, depth: int = 0) -> Any:
    if isinstance(obj, str):
        return float(obj)
    if isinstance(obj, list):
        if depth >= _MAX_DIMS:
            raise ConfigError(f"a BoxSpace bound is nested more than {_MAX_DIMS} lists deep")
        return [_bound_from_json(x, depth + 1) for x in obj]
    return obj


def space_from_json(obj: Any) -> Space:
    """Rebuild a space from `Space.to_json()` output (dict spaces nested at most MAX_DEPTH deep).

    Raises:
        ConfigError: `obj` is not a space description this version understands.
    """
    return _space_from_json(obj, 0)


def _space_from_json(obj: Any, depth: int) -> Space:
    if not isinstance(obj, Mapping) or "type" not in obj:
        raise ConfigError(f"a space description must be a mapping with a 'type', got {obj!r:.200}")
    kind = obj["type"]
    try:
        if kind == "box":
            return BoxSpace(
                _bound_from_json(obj["low"]), _bound_from_json(obj["high"]), tuple(obj["shape"]), obj["dtype"]
            )
        if kind == "binary":
            return BinarySpace(tuple(obj["shape"]))
        if kind == "text":
            return TextSpace(obj["max_length"], obj.get("min_length", 0))
        if kind == "dict":
            spaces = obj["spaces"]
            if not isinstance(spaces, Mapping):
                raise ConfigError("a dict space's 'spaces' must be a mapping")
            if depth >= MAX_DEPTH:
                raise ConfigError(f"dict spaces are nested more than {MAX_DEPTH} deep")
            return DictSpace({k: _space_from_json(v, depth + 1) for k, v in spaces.items()})
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"invalid {kind!r} space description: {exc!r}") from exc
    raise ConfigError(f"unknown space type {kind!r}; expected box, binary, text or dict")

"""gymnasium spaces as h5replay spaces (`space_from_gymnasium`; h5replay.integrations.gym re-exports it).

gymnasium is not a dependency: only the objects' attributes are read, so this module imports
nothing of gymnasium and works with any object shaped like its spaces.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from h5replay.errors import ConfigError
from h5replay.spaces.base import DictSpace, Space
from h5replay.spaces.leaves import BinarySpace, BoxSpace, TextSpace

__all__ = ["space_from_gymnasium", "value_from_gymnasium", "value_to_gymnasium"]


def space_from_gymnasium(space: Any) -> Space:
    """Convert a gymnasium Box / Discrete / MultiDiscrete / MultiBinary / Text / Tuple / Dict
    (nested) into an h5replay space.

    Discrete becomes a scalar int64 Box over [start, start + n - 1], MultiDiscrete an int64 Box
    of its shape over [start, start + nvec - 1]; a Tuple becomes a DictSpace keyed "0", "1", ...
    (`value_from_gymnasium` turns its tuples into such dicts). gymnasium is not a dependency; only
    the objects' attributes are read.

    Raises:
        ConfigError: a space it cannot convert (Graph, Sequence, OneOf, ...), named with where it is.
    """
    return _from(space, "the space")


def _from(space: Any, where: str) -> Space:
    name = type(space).__name__
    if name == "Dict":
        return DictSpace({str(k): _from(v, f"{where}[{k!r}]") for k, v in space.spaces.items()})
    if name == "Tuple":
        if not space.spaces:
            raise ConfigError(f"cannot convert the empty gymnasium Tuple at {where}: it holds nothing to store")
        return DictSpace({str(i): _from(v, f"{where}[{i}]") for i, v in enumerate(space.spaces)})
    if name == "Box":
        return BoxSpace(space.low, space.high, tuple(space.shape), space.dtype)
    if name == "MultiBinary":
        return BinarySpace(tuple(np.atleast_1d(space.n)) if not isinstance(space.n, int) else (space.n,))
    if name == "Text":
        return TextSpace(space.max_length, space.min_length)
    if name == "Discrete":
        first = int(space.start)
        return BoxSpace(first, first + int(space.n) - 1, (), np.int64)
    if name == "MultiDiscrete":
        starts = np.asarray(space.start, np.int64)
        return BoxSpace(starts, starts + np.asarray(space.nvec, np.int64) - 1, tuple(space.shape), np.int64)
    raise ConfigError(f"cannot convert gymnasium space {name} at {where}; supported: Box, Discrete, MultiDiscrete, "
                      "MultiBinary, Text, Tuple, Dict")


def value_from_gymnasium(space: Any, value: Any) -> Any:
    """A sample of gymnasium `space` as the converted space stores it: a Tuple's tuple becomes a
    dict keyed "0", "1", ...; a Discrete's int an int64 scalar; the rest arrays."""
    name = type(space).__name__
    if name == "Dict":
        return {str(k): value_from_gymnasium(sub, value[k]) for k, sub in space.spaces.items()}
    if name == "Tuple":
        return {str(i): value_from_gymnasium(sub, value[i]) for i, sub in enumerate(space.spaces)}
    if name in ("Discrete", "MultiDiscrete"):
        return np.asarray(value, np.int64)
    if name == "Text":
        return value
    return np.asarray(value, space.dtype) if getattr(space, "dtype", None) is not None else np.asarray(value)


def value_to_gymnasium(space: Any, value: Any) -> Any:
    """The inverse of `value_from_gymnasium`: a stored sample (or batch) as gymnasium `space`
    gives it (a Tuple's dict back to a tuple)."""
    name = type(space).__name__
    if name == "Dict":
        return {k: value_to_gymnasium(sub, value[str(k)]) for k, sub in space.spaces.items()}
    if name == "Tuple":
        return tuple(value_to_gymnasium(sub, value[str(i)]) for i, sub in enumerate(space.spaces))
    return value

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

__all__ = ["space_from_gymnasium"]


def space_from_gymnasium(space: Any) -> Space:
    """Convert a gymnasium Box / MultiBinary / Text / Dict (nested) into an h5replay space.

    Discrete becomes a scalar int64 Box over [start, start + n - 1]. gymnasium is not a dependency;
    only the objects' attributes are read.
    """
    name = type(space).__name__
    if name == "Dict":
        return DictSpace({str(k): space_from_gymnasium(v) for k, v in space.spaces.items()})
    if name == "Box":
        return BoxSpace(space.low, space.high, tuple(space.shape), space.dtype)
    if name == "MultiBinary":
        return BinarySpace(tuple(np.atleast_1d(space.n)) if not isinstance(space.n, int) else (space.n,))
    if name == "Text":
        return TextSpace(space.max_length, space.min_length)
    if name == "Discrete":
        start = int(space.start)
        return BoxSpace(start, start + int(space.n) - 1, (), np.int64)
    raise ConfigError(f"cannot convert gymnasium space {name}; supported: Box, MultiBinary, Text, Dict, Discrete")

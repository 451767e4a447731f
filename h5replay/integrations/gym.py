"""gymnasium and h5replay: spaces both ways, and `RecordEpisodes(env, actor)`.

`space_from_gymnasium` / `value_from_gymnasium` read only the objects' attributes (they live with
the spaces, h5replay.spaces.gym, and import nothing of gymnasium). `space_to_gymnasium` builds
gymnasium spaces, and `RecordEpisodes` / `row_space` (h5replay.integrations.gym_record) wrap
gymnasium envs: those import gymnasium when first used (`pip install 'h5replay[gym]'`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from h5replay.errors import ConfigError
from h5replay.spaces import BinarySpace, BoxSpace, DictSpace, Space, TextSpace
from h5replay.spaces.gym import space_from_gymnasium, value_from_gymnasium, value_to_gymnasium

__all__ = ["space_from_gymnasium", "space_to_gymnasium", "value_from_gymnasium", "value_to_gymnasium",
           "RecordEpisodes", "RecordVectorEpisodes", "row_space"]

if TYPE_CHECKING:
    from h5replay.integrations.gym_record import RecordEpisodes, RecordVectorEpisodes, row_space

_RECORDING = ("RecordEpisodes", "RecordVectorEpisodes", "row_space")


def __getattr__(name: str) -> Any:
    if name in _RECORDING:
        from h5replay.integrations import gym_record

        return getattr(gym_record, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def space_to_gymnasium(space: Space) -> Any:
    """The gymnasium space of an h5replay space, the inverse of `space_from_gymnasium`: a
    DictSpace keyed exactly "0" ... "n-1" becomes a Tuple; an int64 Box a Discrete (scalar) or
    MultiDiscrete (what those become; a Box of another dtype, uint8 images included, stays a
    Box); a Binary a MultiBinary (a scalar Binary: Discrete(2)).

    Raises:
        ConfigError: gymnasium is missing, an int64 Box is unbounded (no Discrete holds it), or
            the space is not an h5replay space.
    """
    try:
        import gymnasium
    except ImportError as exc:
        raise ConfigError("space_to_gymnasium needs gymnasium: pip install 'h5replay[gym]'") from exc
    return _to(gymnasium.spaces, space, "the space")


def _to(spaces: Any, space: Space, where: str) -> Any:
    if isinstance(space, DictSpace):
        keys = list(space.keys())
        if sorted(keys, key=lambda k: int(k) if k.isdigit() else -1) == [str(i) for i in range(len(keys))]:
            return spaces.Tuple([_to(spaces, space[str(i)], f"{where}[{i}]") for i in range(len(keys))])
        return spaces.Dict({k: _to(spaces, space[k], f"{where}[{k!r}]") for k in keys})
    if isinstance(space, BinarySpace):
        if space.shape == ():
            return spaces.Discrete(2)
        return spaces.MultiBinary(space.shape[0] if len(space.shape) == 1 else list(space.shape))
    if isinstance(space, TextSpace):
        return spaces.Text(space.max_length, min_length=space.min_length)
    if isinstance(space, BoxSpace):
        low, high = np.broadcast_to(space.low, space.shape), np.broadcast_to(space.high, space.shape)
        if np.dtype(space.dtype) == np.int64:  # what Discrete / MultiDiscrete become
            if not (np.isfinite(low.astype(np.float64)).all() and np.isfinite(high.astype(np.float64)).all()):
                raise ConfigError(f"the int64 Box at {where} is unbounded: no gymnasium Discrete holds it")
            if space.shape == ():
                return spaces.Discrete(int(high - low + 1), start=int(low))
            return spaces.MultiDiscrete((high - low + 1).astype(np.int64), start=low.astype(np.int64))
        return spaces.Box(low, high, space.shape, space.dtype)
    raise ConfigError(f"cannot convert {space!r} at {where} to a gymnasium space")

"""Transitions from episodes: which leaves are the observation, the reward and the episode's end,
and the n-step sums a learner's target needs. Pure numpy.

A transition drawn at row `t` of an episode whose last row is `T` sums `k = min(n, T - t + 1)`
rewards: `reward = sum(gamma ** i * r[t + i] for i < k)`, `discount = gamma ** k`, `next` the
observation of row `t + n` when `t + n <= T`, else the episode's final observation, and
`terminated` / `truncated` those of row `t + k - 1`. So `reward + discount * (1 - terminated) *
V(next)` is the target for every step, the last included. An episode without a final
observation bootstraps its last steps from nothing: `discount` 0 and `truncated` set.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from h5replay.errors import ConfigError
from h5replay.spaces import BoxSpace, DictSpace, Schema, Space

__all__ = ["TransitionKeys", "NStep", "plan_n_step", "check_n_step", "final_schema", "described_keys",
           "declared_observation_keys", "NEXT",
           "DISCOUNT"]

NEXT = "next"  # the key of the next observation in a transition
DISCOUNT = "discount"


@dataclass(frozen=True)
class TransitionKeys:
    """The observation part of a space (top-level keys of its DictSpace) and the leaves that hold
    each step's reward and end flags, recorded in the file when it is created."""

    observation: tuple[str, ...]
    reward: str = "reward"
    terminated: str = "terminated"
    truncated: str = "truncated"

    @classmethod
    def checked(cls, space: Space, observation_keys: Any, reward_key: str = "reward",
                terminated_key: str = "terminated", truncated_key: str = "truncated") -> TransitionKeys:
        """The keys, checked against `space`: a DictSpace holding every observation key, and no
        key named 'next' or 'discount' (a transition adds them).

        Raises:
            ConfigError: names the key that is missing or not allowed.
        """
        if isinstance(observation_keys, str) or not observation_keys:
            raise ConfigError(f"observation_keys is a non-empty sequence of the space's keys, got {observation_keys!r}")
        keys = tuple(observation_keys)
        if not isinstance(space, DictSpace):
            raise ConfigError(f"observation_keys needs a Dict space (keys naming its observation), got {space!r}")
        for key in keys:
            if not isinstance(key, str) or key not in space.keys():
                raise ConfigError(f"observation key {str(key)[:80]!r} is not a key of the space: its keys are "
                                  f"{', '.join(map(repr, space.keys()))}")
        if len(set(keys)) != len(keys):
            raise ConfigError(f"observation_keys names a key twice: {list(keys)}")
        for taken in (NEXT, DISCOUNT):
            if taken in space.keys():
                raise ConfigError(f"a space with observation_keys may not have a key {taken!r}: transitions add it")
        for what, name in (("reward_key", reward_key), ("terminated_key", terminated_key),
                           ("truncated_key", truncated_key)):
            if not isinstance(name, str) or not name:
                raise ConfigError(f"{what} is a key of the space, got {name!r}")
            if name in keys:
                raise ConfigError(f"{what} {name!r} is one of the observation keys")
        return cls(keys, reward_key, terminated_key, truncated_key)

    def observation_space(self, space: Space) -> DictSpace:
        """The part of `space` a final observation is a sample of."""
        return DictSpace({key: space[key] for key in self.observation})  # type: ignore[index]

    def as_observation(self, final: Any) -> Any:
        """A final as `final=` takes it (the one observation key's value, or a dict of the
        keys: always when there are several, and also `{key: value}` for the one) as a sample of
        `observation_space`."""
        if len(self.observation) != 1:
            return final
        key = self.observation[0]
        if isinstance(final, Mapping) and set(final) == {key}:
            return dict(final)
        return {key: final}

    def as_final(self, observation: Any) -> Any:
        """The inverse of `as_observation`: a decoded sample of `observation_space` as `final=` took it."""
        return observation[self.observation[0]] if len(self.observation) == 1 else observation

    def transition_space(self, space: Space) -> DictSpace:
        """What `sample_transitions` returns: the step's leaves, `next` and `discount`."""
        spaces = dict(space.spaces)  # type: ignore[attr-defined]
        spaces[NEXT] = self.observation_space(space)
        spaces[DISCOUNT] = BoxSpace(0.0, 1.0, (), np.float32)
        return DictSpace(spaces)

    def check_sampling(self, space: Space) -> None:
        """Raises ConfigError naming a reward or end-flag key the space lacks."""
        for what, name in (("reward", self.reward), ("terminated", self.terminated), ("truncated", self.truncated)):
            if name not in space.keys():  # type: ignore[attr-defined]
                raise ConfigError(f"sample_transitions needs the {what} leaf {name!r}, which the space lacks (its keys: "
                                  f"{', '.join(map(repr, space.keys()))}); name it when the file is created "  # type: ignore[attr-defined]
                                  f"({what}_key=)")

    def to_json(self) -> str:
        return json.dumps({"observation_keys": list(self.observation), "reward_key": self.reward,
                           "terminated_key": self.terminated, "truncated_key": self.truncated})

    @classmethod
    def from_json(cls, text: str, space: Space) -> TransitionKeys:
        try:
            obj = json.loads(text)
            return cls.checked(space, obj["observation_keys"], obj["reward_key"], obj["terminated_key"],
                               obj["truncated_key"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"damaged transition keys {text[:200]!r}: {exc}") from None


def described_keys(space: Space, described: Mapping[str, Any]) -> TransitionKeys | None:
    """The transition keys a server's hello `sampling` names (None: it keeps no finals)."""
    text = described.get("transition_keys")
    return TransitionKeys.from_json(text, space) if isinstance(text, str) else None


def declared_observation_keys(path: str) -> tuple[str, ...] | None:
    """The "observation_keys" a space file (`serve --space`) declares beside its space (None: none).

    Raises:
        ConfigError: they are not a list of strings.
    """
    with open(path, encoding="utf-8") as fh:  # (a file the caller read as a space already)
        declared = json.load(fh).get("observation_keys")
    if declared is not None and (not isinstance(declared, list) or not all(isinstance(k, str) for k in declared)):
        raise ConfigError(f"{path!r}: observation_keys must be a list of the space's keys, got {declared!r:.80}")
    return tuple(declared) if declared else None


def final_schema(space: Space, described: Mapping[str, Any]) -> tuple[Schema, TransitionKeys] | None:
    """The schema of a server's final observations and its transition keys, from its hello
    `sampling` (None: the server keeps no finals)."""
    keys = described_keys(space, described)
    return None if keys is None else (Schema(keys.observation_space(space)), keys)


def check_n_step(n_step: Any, gamma: Any) -> tuple[int, float]:
    """Raises ConfigError unless `n_step` is an integer >= 1 and `gamma` a number in [0, 1]."""
    if isinstance(n_step, bool) or not isinstance(n_step, (int, np.integer)) or n_step < 1:
        raise ConfigError(f"n_step must be an integer >= 1, got {n_step!r}")
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float, np.floating, np.integer)) \
            or not math.isfinite(float(gamma)) or not 0.0 <= float(gamma) <= 1.0:
        raise ConfigError(f"gamma must be a number in [0, 1], got {gamma!r}")
    return int(n_step), float(gamma)


@dataclass(frozen=True)
class NStep:
    """Which rows a batch of n-step transitions reads, and how their rewards are summed."""

    reward_ids: np.ndarray  # (b, n) row ids of the rewards summed (the start row where none is summed)
    summed: np.ndarray  # (b, n) bool: whether that reward is summed
    steps: np.ndarray  # (b,) k, the rewards summed
    last_ids: np.ndarray  # (b,) the last row used: its terminated / truncated are the transition's
    next_ids: np.ndarray  # (b,) the row whose observation is `next` (-1: the episode's final)
    weights: np.ndarray  # (n,) gamma ** i

    def reward(self, rewards: np.ndarray) -> np.ndarray:
        """The discounted sum of the (b, n, ...) rewards read at `reward_ids`."""
        weights = np.where(self.summed, self.weights[None, :], 0.0)
        weights = weights.reshape(weights.shape + (1,) * (rewards.ndim - 2))
        summed: np.ndarray = (rewards.astype(np.float64) * weights).sum(axis=1)
        return summed

    def discount(self, gamma: float) -> np.ndarray:
        """gamma ** k for the k rewards summed (float32)."""
        discount: np.ndarray = np.power(gamma, self.steps).astype(np.float32)
        return discount


def plan_n_step(starts: np.ndarray, lasts: np.ndarray, n: int, gamma: float) -> NStep:
    """The rows n-step transitions from rows `starts` read, in episodes whose last rows are `lasts`."""
    k = np.minimum(n, lasts - starts + 1)
    offsets = np.arange(n, dtype=np.int64)
    summed = offsets[None, :] < k[:, None]
    reward_ids = np.where(summed, starts[:, None] + offsets[None, :], starts[:, None])
    next_ids = np.where(starts + n <= lasts, starts + n, -1)
    return NStep(reward_ids, summed, k, starts + k - 1, next_ids, gamma ** offsets.astype(np.float64))

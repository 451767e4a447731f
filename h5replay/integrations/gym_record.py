"""`RecordEpisodes(env, actor)`: a gymnasium wrapper that commits each episode as it ends, with its
final observation, to an h5replay actor (a server's `ActorClient`, one or several shards).

A row is one step: the observation the action was taken in, the action, the reward and the end
flags (`row_space`). The observation after the last step is the episode's final observation,
stored when the server keeps them (`actor.keeps_finals`). On a `gymnasium.vector` env each
sub-env streams its own segment; every autoreset mode is followed (next-step, same-step with
`info["final_obs"]`, disabled). An episode left by a `reset()` before it ended is committed
without a final observation (a learner's `sample_transitions` then bootstraps it from nothing).
Imports gymnasium: `pip install 'h5replay[gym]'`.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv, VectorWrapper

from h5replay.errors import ConfigError, SpaceMismatchError
from h5replay.spaces import BinarySpace, BoxSpace, DictSpace
from h5replay.spaces.gym import space_from_gymnasium, value_from_gymnasium

__all__ = ["RecordEpisodes", "RecordVectorEpisodes", "row_space"]


def row_space(observation_space: Any, action_space: Any) -> DictSpace:
    """The space of one recorded step: obs, action, reward, terminated, truncated."""
    return DictSpace({
        "obs": space_from_gymnasium(observation_space),
        "action": space_from_gymnasium(action_space),
        "reward": BoxSpace(-np.inf, np.inf, (), np.float32),
        "terminated": BinarySpace(),
        "truncated": BinarySpace(),
    })


def _check_actor(actor: Any, space: DictSpace, what: str) -> None:
    if actor.space != space:
        raise SpaceMismatchError(f"the actor's server stores {actor.space!r}, not the steps of {what} "
                                 f"({space!r}): serve a file created with row_space(env.observation_space, "
                                 "env.action_space)")


class _Episode:
    """One sub-env's open episode: the observation its next action is taken in, and its segment."""

    def __init__(self, actor: Any, observation_space: Any, action_space: Any) -> None:
        self.actor = actor
        self.observation_space = observation_space
        self.action_space = action_space
        self.obs: Any = None
        self.segment: Any = None
        self.committed = 0  # episodes committed

    def begin(self, obs: Any) -> None:
        self.cut()
        self.obs = value_from_gymnasium(self.observation_space, obs)

    def step(self, action: Any, next_obs: Any, reward: Any, terminated: Any, truncated: Any) -> None:
        if self.obs is None:
            raise ConfigError("step() before reset(): the episode has no first observation")
        if self.segment is None:
            self.segment = self.actor.segment()
        self.segment.append({
            "obs": self.obs, "action": value_from_gymnasium(self.action_space, action),
            "reward": np.asarray(reward, np.float32), "terminated": np.asarray(bool(terminated)),
            "truncated": np.asarray(bool(truncated)),
        })
        self.obs = value_from_gymnasium(self.observation_space, next_obs)
        if terminated or truncated:
            segment, self.segment, final, self.obs = self.segment, None, self.obs, None
            segment.commit(final=final if self.actor.keeps_finals else None)
            self.committed += 1

    def cut(self) -> None:
        """Commit what was recorded of an episode left before it ended (no final observation)."""
        if self.segment is not None:
            segment, self.segment = self.segment, None
            segment.commit()
            self.committed += 1


class RecordEpisodes(gym.Wrapper):  # type: ignore[misc,unused-ignore]  # Any where gymnasium has no types
    """Commit each episode of `env` to `actor` as it ends, with its final observation.

    `RecordEpisodes(vector_env, actor)` gives a `RecordVectorEpisodes`. `close()` commits the
    open episode (as cut short) and closes the env, not the actor.

    Raises:
        SpaceMismatchError: the actor's server does not store `row_space` of the env's spaces.
    """

    def __new__(cls, env: Any, actor: Any) -> Any:
        if isinstance(env, VectorEnv):
            return RecordVectorEpisodes(env, actor)
        return super().__new__(cls)

    def __init__(self, env: Any, actor: Any) -> None:
        super().__init__(env)
        _check_actor(actor, row_space(env.observation_space, env.action_space), f"env {env}")
        self.actor = actor
        self._episode = _Episode(actor, env.observation_space, env.action_space)

    @property
    def episodes_committed(self) -> int:
        return self._episode.committed

    def reset(self, **kwargs: Any) -> Any:
        obs, info = self.env.reset(**kwargs)
        self._episode.begin(obs)
        return obs, info

    def step(self, action: Any) -> Any:
        obs, reward, terminated, truncated, info = self.env.step(action)
        self._episode.step(action, obs, reward, terminated, truncated)
        return obs, reward, terminated, truncated, info

    def close(self) -> None:
        try:
            self._episode.cut()
        finally:
            super().close()


class RecordVectorEpisodes(VectorWrapper):  # type: ignore[misc,unused-ignore]
    """`RecordEpisodes` of a `gymnasium.vector` env: one segment per sub-env."""

    def __init__(self, env: Any, actor: Any) -> None:
        super().__init__(env)
        _check_actor(actor, row_space(env.single_observation_space, env.single_action_space), f"env {env}")
        self.actor = actor
        self._mode = AutoresetMode(env.metadata.get("autoreset_mode", AutoresetMode.NEXT_STEP))
        self._episodes = [_Episode(actor, env.single_observation_space, env.single_action_space)
                          for _ in range(env.num_envs)]
        self._resetting = np.zeros(env.num_envs, bool)  # next-step mode: this step resets the sub-env

    @property
    def episodes_committed(self) -> int:
        return sum(e.committed for e in self._episodes)

    def reset(self, **kwargs: Any) -> Any:
        obs, info = self.env.reset(**kwargs)
        mask = (kwargs.get("options") or {}).get("reset_mask")
        for i, episode in enumerate(self._episodes):
            if mask is None or mask[i]:
                episode.begin(_at(obs, i))
                self._resetting[i] = False
        return obs, info

    def step(self, actions: Any) -> Any:
        obs, rewards, terminated, truncated, info = self.env.step(actions)
        for i, episode in enumerate(self._episodes):
            if self._resetting[i]:  # next-step autoreset: this step only reset the sub-env
                episode.begin(_at(obs, i))
                self._resetting[i] = False
                continue
            done = bool(terminated[i] or truncated[i])
            if done and self._mode is AutoresetMode.SAME_STEP:  # obs is already the next episode's
                episode.step(_at(actions, i), _at(info["final_obs"], i), rewards[i], terminated[i], truncated[i])
                episode.begin(_at(obs, i))
                continue
            episode.step(_at(actions, i), _at(obs, i), rewards[i], terminated[i], truncated[i])
            self._resetting[i] = done and self._mode is AutoresetMode.NEXT_STEP
        return obs, rewards, terminated, truncated, info

    def close(self, **kwargs: Any) -> None:
        try:
            for episode in self._episodes:
                episode.cut()
        finally:
            super().close(**kwargs)


def _at(value: Any, i: int) -> Any:
    """Sub-env `i`'s part of a vector env's batched value (dicts and tuples of arrays too)."""
    if isinstance(value, dict):
        return {k: _at(v, i) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_at(v, i) for v in value)
    return value[i]

"""Stable-Baselines3: `H5ReplayBuffer`, SB3's `ReplayBuffer` kept in an h5replay file or server.

    DQN("MlpPolicy", env, replay_buffer_class=H5ReplayBuffer,
        replay_buffer_kwargs={"path": "replay.h5"})            # a local file
        replay_buffer_kwargs={"endpoint": "tcp://host:5555"})  # a server, shared by SB3 processes

Each row is one transition of one sub-env, as SB3 adds it: `obs`, `action` (SB3's stored form:
scaled to [-1, 1] for Box actions), `reward`, `next_obs` (the terminal observation at an
episode's end, as SB3 passes it), `done`, and `timeout` (a time-limit truncation, from
`infos[i]["TimeLimit.truncated"]` with `handle_timeout_termination`). `sample` draws uniformly
over every transition held, the other processes' too, and returns SB3's `ReplayBufferSamples`
with `dones = done * (1 - timeout)`, so a truncated step bootstraps. A row is visible once added
(a file) or once the server acknowledged it (it is sent without waiting). A local file is made
durable at each `sample` (each training step) and at `close`. Pickling the buffer (`model.save_replay_buffer`)
saves where it lives, not its rows: loading it opens that file or server again.

A server for it: `h5replay serve --space` of `H5ReplayBuffer.space_json(observation_space,
action_space)`. Needs stable-baselines3 (`pip install 'h5replay[sb3]'`).
"""

from __future__ import annotations

import collections
import os
from typing import Any

import numpy as np

try:
    from gymnasium import spaces as gym_spaces
    from stable_baselines3.common.buffers import BaseBuffer, ReplayBuffer
    from stable_baselines3.common.type_aliases import ReplayBufferSamples
except ImportError as exc:  # pragma: no cover - exercised only without stable-baselines3
    raise ImportError("h5replay.integrations.sb3 needs stable-baselines3: pip install 'h5replay[sb3]'") from exc

from h5replay.errors import ConfigError, NotEnoughDataError, SpaceMismatchError
from h5replay.spaces import BinarySpace, BoxSpace, DictSpace

__all__ = ["H5ReplayBuffer", "transition_space"]

_IN_FLIGHT = 8  # adds sent to a server and not yet acknowledged, at most


def transition_space(observation_space: Any, action_space: Any) -> DictSpace:
    """The row space of SB3 transitions of these gymnasium spaces (as SB3 shapes them).

    Raises:
        ConfigError: a Dict observation space (SB3's DictReplayBuffer), or a space SB3's
            ReplayBuffer does not store.
    """
    from stable_baselines3.common.preprocessing import get_action_dim, get_obs_shape

    if isinstance(observation_space, gym_spaces.Dict):
        raise ConfigError("H5ReplayBuffer stores Box / Discrete / MultiDiscrete / MultiBinary observations; a Dict "
                          "observation space needs SB3's DictReplayBuffer, which h5replay does not replace yet")
    shape: Any = get_obs_shape(observation_space)  # a tuple: Dict spaces are refused above
    obs = _unbounded(tuple(shape), observation_space.dtype, "observation")
    action_dtype = np.float32 if action_space.dtype == np.float64 else action_space.dtype
    return DictSpace({
        "obs": obs, "next_obs": obs,
        "action": _unbounded((get_action_dim(action_space),), action_dtype, "action"),
        "reward": BoxSpace(-np.inf, np.inf, (), np.float32),
        "done": BinarySpace(), "timeout": BinarySpace(),
    })


def _unbounded(shape: tuple[int, ...], dtype: Any, what: str) -> BoxSpace:
    """Rows as SB3 keeps them: any value of the dtype (SB3 stores what the env gave, in or out of
    the space's bounds, and scaled actions)."""
    dt = np.dtype(dtype)
    if np.issubdtype(dt, np.floating):
        return BoxSpace(-np.inf, np.inf, shape, dt)
    if np.issubdtype(dt, np.integer):
        info = np.iinfo(dt)
        return BoxSpace(int(info.min), int(info.max), shape, dt)
    if dt == np.bool_:
        return BoxSpace(0, 1, shape, np.int8)
    raise ConfigError(f"H5ReplayBuffer cannot store {what}s of dtype {dt}")


class H5ReplayBuffer(ReplayBuffer):  # type: ignore[misc,unused-ignore]  # Any without stable-baselines3 installed
    """SB3's ReplayBuffer in an h5replay file (`path`) or server (`endpoint`): the same `add`
    and `sample`, any number of SB3 processes on one server, and a file that outlives the run.

    Args (beyond SB3's): path: an HDF5 file, created with capacity `buffer_size` (opened and
        continued when it exists: its space must be these spaces' transitions); endpoint: a
        server's endpoint instead (its space: `space_json`); timeout: seconds a request to the
        server may take.

    Raises:
        ConfigError: neither or both of path and endpoint, optimize_memory_usage (h5replay
            keeps rows on disk: it does not apply), a Dict observation space.
        SpaceMismatchError: the file or server holds rows of another space.
    """

    def __init__(
        self,
        buffer_size: int,
        observation_space: Any,
        action_space: Any,
        device: Any = "auto",
        n_envs: int = 1,
        optimize_memory_usage: bool = False,
        handle_timeout_termination: bool = True,
        *,
        path: str | os.PathLike[str] | None = None,
        endpoint: str | None = None,
        timeout: float = 30.0,
    ) -> None:
        BaseBuffer.__init__(self, buffer_size, observation_space, action_space, device, n_envs=n_envs)
        if (path is None) == (endpoint is None):
            raise ConfigError("H5ReplayBuffer takes a local file (path=) or a server (endpoint=): exactly one")
        if optimize_memory_usage:
            raise ConfigError("optimize_memory_usage does not apply to H5ReplayBuffer: its rows are on disk, not in "
                              "memory (leave it False)")
        self.handle_timeout_termination = handle_timeout_termination
        self.optimize_memory_usage = False
        self.space = transition_space(observation_space, action_space)
        self.path = None if path is None else os.fspath(path)
        self.endpoint = endpoint
        self.timeout = float(timeout)
        self._open()

    @staticmethod
    def space_json(observation_space: Any, action_space: Any) -> dict[str, Any]:
        """The space file of a server for these spaces (`h5replay serve --space FILE`)."""
        return transition_space(observation_space, action_space).to_json()

    def _open(self) -> None:
        from h5replay.client import ActorClient, LearnerClient
        from h5replay.storage import ReplayBuffer as Replay

        self._rb: Any = None
        self._actor: Any = None
        self._learner: Any = None
        self._in_flight: collections.deque[Any] = collections.deque()
        self._unflushed = False
        if self.path is not None:
            if not os.path.exists(self.path):
                self._rb = Replay.create(self.space, max(self.buffer_size, self.n_envs), self.path)
                return
            self._rb = Replay.load_from(self.path, read_only=False)
            if self._rb.space != self.space:
                stored = self._rb.space
                self.close()
                raise SpaceMismatchError(f"{self.path} holds rows of {stored!r}, not these spaces' transitions "
                                         f"{self.space!r}")
            return
        endpoint = str(self.endpoint)
        self._actor = ActorClient(endpoint, timeout=self.timeout)
        self._learner = LearnerClient(endpoint, timeout=self.timeout)
        if self._actor.space != self.space:
            server = self._actor.space
            self.close()
            raise SpaceMismatchError(f"the server at {self.endpoint} stores {server!r}, not these spaces' transitions "
                              f"{self.space!r}: serve it with --space of H5ReplayBuffer.space_json(...)")

    def add(self, obs: np.ndarray, next_obs: np.ndarray, action: np.ndarray, reward: np.ndarray, done: np.ndarray,
            infos: list[dict[str, Any]]) -> None:
        """Store one transition per sub-env (as SB3's ReplayBuffer.add takes them)."""
        n = self.n_envs
        timeouts = [bool(info.get("TimeLimit.truncated", False)) for info in infos] \
            if self.handle_timeout_termination else [False] * n
        rows = {
            "obs": np.asarray(obs).reshape(n, *self.obs_shape), "next_obs": np.asarray(next_obs).reshape(n, *self.obs_shape),
            "action": np.asarray(action).reshape(n, self.action_dim),
            "reward": np.asarray(reward, np.float32).reshape(n), "done": np.asarray(done).reshape(n).astype(bool),
            "timeout": np.asarray(timeouts, bool).reshape(n),
        }
        if self._rb is not None:
            self._rb.extend(rows)
            self._unflushed = True
        else:
            while len(self._in_flight) >= _IN_FLIGHT or (self._in_flight and self._in_flight[0].done()):
                self._in_flight.popleft().result()  # raises what the server refused
            self._in_flight.append(self._actor.push_episode(rows, wait=False))

    def size(self) -> int:
        """Transitions held (every process's, on a server)."""
        return len(self._rb) if self._rb is not None else len(self._learner)

    def sample(self, batch_size: int, env: Any = None) -> ReplayBufferSamples:
        """`batch_size` transitions drawn uniformly with replacement from all held.

        From a file, the draws are SB3's own (`np.random.randint` of a position, then of a
        sub-env), so a run seeded as one with SB3's buffer samples the same transitions. From a
        server, the server draws over every process's rows, seeded from numpy's global state.

        Raises:
            NotEnoughDataError: nothing is held yet.
        """
        if self._rb is not None:
            if self._unflushed:  # durable up to each training step; and reads of flushed rows are 2x faster
                self._rb.flush()
                self._unflushed = False
            held = len(self._rb)
            positions = held // self.n_envs  # whole adds held (a ring of odd capacity cuts its oldest)
            if not positions:
                raise NotEnoughDataError(f"the replay holds {held} transitions, fewer than one add of "
                                         f"{self.n_envs} sub-envs")
            batch_inds = np.random.randint(0, positions, size=batch_size)
            env_indices = np.random.randint(0, high=self.n_envs, size=(batch_size,))
            batch = self._rb.get_at(held - positions * self.n_envs + batch_inds * self.n_envs + env_indices)
        else:
            while self._in_flight:  # this process's own adds are visible to its samples
                self._in_flight.popleft().result()
            batch = self._learner.sample(batch_size, int(np.random.randint(0, 2**62)))
        data = (
            self._normalize_obs(batch["obs"], env),
            batch["action"],
            self._normalize_obs(batch["next_obs"], env),
            (batch["done"].astype(np.float32) * (1.0 - batch["timeout"].astype(np.float32))).reshape(-1, 1),
            self._normalize_reward(batch["reward"].reshape(-1, 1), env),
        )
        return ReplayBufferSamples(*tuple(map(self.to_torch, data)))

    def _get_samples(self, batch_inds: np.ndarray, env: Any = None) -> ReplayBufferSamples:
        raise NotImplementedError("H5ReplayBuffer samples rows by id, not by SB3's positions: call sample()")

    def close(self) -> None:
        """Flush and close the file, or settle the adds in flight and close the clients."""
        try:
            while self._in_flight:
                self._in_flight.popleft().result()
        finally:
            for handle in (self._rb, self._actor, self._learner):
                if handle is not None:
                    handle.close()
            self._rb = self._actor = self._learner = None

    def __getstate__(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if k not in ("_rb", "_actor", "_learner", "_in_flight")}
        if self._rb is not None:
            self._rb.flush()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._open()

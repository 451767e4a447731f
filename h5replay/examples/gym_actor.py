"""`h5replay actor`: a random policy in a real gymnasium environment, streaming every episode.

One row per step: the observation the action was chosen from, the action, the reward that
followed, and whether the episode ended there (terminated) or was cut short (truncated). The
final observation of an episode is not stored. The row space is built from the environment's own
spaces by `space_from_gymnasium`, and must equal the server's: `h5replay space gym ENV_ID` prints
it, so a server can be started with exactly that space.

SIGTERM or SIGINT ends the run after the current step: that step is recorded as truncated and the
episode committed, so the file never holds half an episode. Whatever the server does (gone,
stopped, never answering), the actor exits within 2 s of the signal: the commit gets a grace of
1 s (`STOP_GRACE`), and then, or at a second signal, the open episode is given up (the server
never shows it) and the actor exits. gymnasium is optional and imported only here, when an actor
runs (`pip install h5replay[gym]`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from h5replay.errors import CommitInDoubtError, ConfigError, SpaceMismatchError
from h5replay.spaces import DictSpace, Space, named_leaves

__all__ = ["gym_row_space", "make_env", "run_actor", "space_json", "stop_on_signals", "Stopped", "STOP_GRACE", "PIXELS_SHAPE"]

log = logging.getLogger("h5replay.examples.actor")

#: (height, width) of the frames `--pixels` records: the 400x600 render, a sixth of it each way.
PIXELS_SHAPE = (64, 96)


def _gymnasium() -> Any:
    try:
        import gymnasium
    except ImportError as exc:
        raise ConfigError(
            "the gymnasium examples need gymnasium: pip install 'h5replay[gym]' (or pip install gymnasium)"
        ) from exc
    return gymnasium


def make_env(env_id: str = "CartPole-v1", *, pixels: bool = False) -> Any:
    """A gymnasium environment; with `pixels`, its observations are its rendered frames, downscaled
    to `PIXELS_SHAPE` + (3,) uint8 (classic-control environments render with pygame).

    Raises:
        ConfigError: gymnasium (or, for pixels, pygame) is missing, or `env_id` is unknown.
    """
    gym = _gymnasium()
    if pixels:
        if importlib.util.find_spec("pygame") is None:
            raise ConfigError("--pixels renders frames with pygame: pip install 'gymnasium[classic-control]'")
        # Render off-screen: containers and CI have no display, and nothing should make a sound.
        os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
        os.environ.setdefault("SDL_AUDIODRIVER", "dummy")
    try:
        env = gym.make(env_id, render_mode="rgb_array") if pixels else gym.make(env_id)
    except gym.error.Error as exc:
        raise ConfigError(f"gymnasium cannot make {env_id!r}: {exc}") from exc
    return _with_pixel_observations(gym, env) if pixels else env


def _with_pixel_observations(gym: Any, env: Any) -> Any:
    height, width = PIXELS_SHAPE

    class PixelObservation(gym.ObservationWrapper):  # type: ignore[misc]
        """Replaces the observation with the rendered frame, downscaled by nearest neighbour
        (gymnasium's ResizeObservation would need OpenCV)."""

        def __init__(self, inner: Any) -> None:
            super().__init__(inner)
            self.observation_space = gym.spaces.Box(0, 255, (height, width, 3), np.uint8)
            self._rows: np.ndarray | None = None
            self._cols: np.ndarray | None = None

        def observation(self, observation: Any) -> np.ndarray:
            frame = np.asarray(self.env.render())
            if self._rows is None or self._cols is None:
                self._rows = np.linspace(0, frame.shape[0] - 1, height).round().astype(np.intp)[:, None]
                self._cols = np.linspace(0, frame.shape[1] - 1, width).round().astype(np.intp)
            return np.ascontiguousarray(frame[self._rows, self._cols, :3], dtype=np.uint8)

    return PixelObservation(env)


def gym_row_space(env: Any) -> DictSpace:
    """The space of one step of `env`: obs, action, reward, terminated, truncated."""
    from h5replay.integrations.gym_record import row_space

    return row_space(env.observation_space, env.action_space)


def space_json(env_id: str = "CartPole-v1", *, pixels: bool = False) -> dict[str, Any]:
    """The JSON form of `gym_row_space` for `env_id`, as `serve --space` reads it."""
    env = make_env(env_id, pixels=pixels)
    try:
        # `serve --space` takes the observation keys from here: episodes keep their final observation.
        return {**gym_row_space(env).to_json(), "observation_keys": ["obs"]}
    finally:
        env.close()


STOP_GRACE = 1.0  # seconds an actor may spend committing its last episode after a stop signal


class Stopped(Exception):
    """The grace after a stop signal ended, or a second signal came: the open episode is given up."""


@contextlib.contextmanager
def stop_on_signals(grace: float = STOP_GRACE, give_up: Callable[[], None] | None = None) -> Iterator[threading.Event]:
    """An event set by SIGTERM or SIGINT while the block runs (main thread only; elsewhere the
    event is only set by whoever holds it). `grace` seconds after that first signal, or at a
    second one, `give_up()` is called (close the client: nothing may wait on the server any more)
    and `Stopped` is raised wherever the main thread is, a blocking ZeroMQ call included. The
    previous handlers come back afterwards."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def hard_stop(*_: Any) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        if give_up is not None:
            give_up()
        raise Stopped

    def handler(*_: Any) -> None:
        if stop.is_set():
            hard_stop()
        stop.set()
        signal.setitimer(signal.ITIMER_REAL, grace)  # SIGALRM: hard_stop

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    previous[signal.SIGALRM] = signal.signal(signal.SIGALRM, hard_stop)
    try:
        yield stop
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, old in previous.items():
            signal.signal(sig, old)


def _space_differences(server: Space, local: Space) -> list[str]:
    theirs, ours = dict(named_leaves(server)), dict(named_leaves(local))
    out = []
    for path in sorted(set(theirs) | set(ours)):
        a, b = theirs.get(path), ours.get(path)
        if a is None:
            out.append(f"'{path}' only in the environment's space")
        elif b is None:
            out.append(f"'{path}' only in the server's space")
        elif a != b:
            out.append(f"'{path}': server {a!r}, environment {b!r}" if repr(a) != repr(b)
                       else f"'{path}': same shape and dtype, other bounds")
    return out


def _check_space(server: Space, local: Space, endpoint: str, env_id: str, pixels: bool) -> None:
    if server == local:
        return
    remedy = f"h5replay space gym {env_id}{' --pixels' if pixels else ''} > space.json"
    raise SpaceMismatchError(
        f"the server at {endpoint} stores {server!r} but {env_id} steps are {local!r} "
        f"({'; '.join(_space_differences(server, local))}); serve a new file made for this environment: "
        f"`{remedy}` then `h5replay serve FILE --space space.json`"
    )


class _Tally:
    """Episodes, steps and returns since the start and since the last log line."""

    def __init__(self) -> None:
        self.started = self.since = time.monotonic()
        self.episodes = self.steps = 0
        self.total_return = 0.0
        self.recent_steps = 0
        self.recent_returns: list[float] = []

    def add(self, steps: int, episode_return: float) -> None:
        self.episodes += 1
        self.steps += steps
        self.total_return += episode_return
        self.recent_steps += steps
        self.recent_returns.append(episode_return)

    def line(self) -> str:
        now = time.monotonic()
        n = len(self.recent_returns)
        text = (
            f"{self.episodes} episodes, {self.steps} steps in {now - self.started:.1f} s; last {n}: "
            f"mean length {self.recent_steps / max(1, n):.1f}, mean return {np.mean(self.recent_returns or [0.0]):.2f}, "
            f"{self.recent_steps / max(1e-9, now - self.since):,.0f} steps/s"
        )
        self.since, self.recent_steps, self.recent_returns = now, 0, []
        return text

    def summary(self) -> str:
        elapsed = max(1e-9, time.monotonic() - self.started)
        n = max(1, self.episodes)
        return (
            f"{self.episodes} episodes, {self.steps} steps in {elapsed:.1f} s ({self.steps / elapsed:,.0f} steps/s); "
            f"mean length {self.steps / n:.1f}, mean return {self.total_return / n:.2f}"
        )


def _stream_episode(env: Any, client: Any, stop: threading.Event, seed: int | None) -> tuple[int, float]:
    """Run one episode with a random policy, streaming each step; commits it on the way out of the
    segment (aborts it if anything raises). Returns (steps, return). A commit in doubt (over
    several shards) is logged and counted: the client keeps the episode and settles it."""
    obs, _ = env.reset(seed=seed)
    steps, episode_return = 0, 0.0
    try:
        with client.segment() as seg:
            while True:
                action = env.action_space.sample()
                next_obs, reward, terminated, truncated, _ = env.step(action)
                # A stop request cuts the episode here, recorded as gymnasium records a time limit.
                truncated = bool(truncated) or (stop.is_set() and not terminated)
                seg.append({
                    # Arrays of exactly the stored dtype and shape take the actor's fast path.
                    "obs": obs,
                    "action": np.asarray(action),
                    "reward": np.asarray(reward, np.float32),
                    "terminated": np.asarray(bool(terminated)),
                    "truncated": np.asarray(truncated),
                })
                steps += 1
                episode_return += float(reward)
                if terminated or truncated:
                    if client.keeps_finals:  # the observation after the last step, for bootstrapping
                        seg.set_final(next_obs)
                    break
                obs = next_obs
    except CommitInDoubtError as exc:
        log.warning("%s", exc)
    return steps, episode_return


def run_actor(
    endpoint: str | Sequence[str],
    env_id: str = "CartPole-v1",
    episodes: int = 0,
    seed: int | None = None,
    timeout: float = 30.0,
    secret_key: str | None = None,
    server_key: str | None = None,
    *,
    pixels: bool = False,
    log_every: int = 100,
) -> int:
    """Stream `episodes` episodes (0: until SIGTERM / SIGINT) of a random policy in `env_id`.
    `endpoint` may be a list of several servers (shards): the actor writes to one, failing over.

    Blocks for the whole run. The hello waits up to `timeout` for the server to come up; every
    later request also gets `timeout`. Empty key paths mean no key (compose passes `--secret-key=`).

    Returns:
        0 after the episodes were committed, or after a signal (the current episode committed,
        marked truncated; or given up, never visible, when the server did not acknowledge it
        within `STOP_GRACE`).

    Raises:
        ConfigError: gymnasium is missing or `env_id` is unknown.
        SpaceMismatchError: the server's space is not this environment's row space.
        ServerUnavailableError: the server did not answer within `timeout` (the open episode is
            aborted; the ones before it stay committed).
    """
    from h5replay.client import ActorClient
    from h5replay.config import process_name

    if episodes < 0:
        raise ConfigError(f"episodes must be >= 0 (0: until stopped), got {episodes}")
    env = make_env(env_id, pixels=pixels)
    tally = _Tally()
    try:
        local = gym_row_space(env)
        if seed is not None:
            env.action_space.seed(seed)
        where: dict[str, Any] = ({"endpoint": endpoint} if isinstance(endpoint, str) else
                                 {"endpoint": endpoint[0]} if len(endpoint) == 1 else {"endpoints": list(endpoint)})
        clients: list[Any] = []  # the client, for the signal handler to close

        def close_clients() -> None:
            for c in clients:
                c.close()

        try:
            with stop_on_signals(give_up=close_clients) as stop:
                with ActorClient(timeout=timeout, name=process_name(f"{env_id}-actor"),
                                 secret_key=secret_key or None, server_key=server_key or None, **where) as client:
                    clients.append(client)
                    endpoint = " ".join(where.get("endpoints", [where.get("endpoint", "")]))
                    _check_space(client.space, local, endpoint, env_id, pixels)
                    log.info("streaming %s episodes%s to %s", env_id, " (pixels)" if pixels else "", endpoint)
                    while not stop.is_set() and (episodes == 0 or tally.episodes < episodes):
                        steps, episode_return = _stream_episode(env, client, stop,
                                                                seed if tally.episodes == 0 else None)
                        tally.add(steps, episode_return)
                        if log_every and tally.episodes % log_every == 0:
                            log.info("%s", tally.line())
                    if not stop.is_set():  # over several shards: episodes kept in doubt go to their shard
                        for record in client.settle(timeout):
                            log.error("an episode of %d rows is still in doubt on shard %d", record.length,
                                      record.shard)
                if stop.is_set():
                    log.info("stopped by a signal")
        except Stopped:
            log.info("stopped by a signal; the server did not acknowledge the open episode within %g s: given up "
                     "(never visible)", STOP_GRACE)
    finally:
        env.close()
    log.info("done: %s", tally.summary())
    return 0

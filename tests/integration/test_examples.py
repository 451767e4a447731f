"""The examples behind `h5replay actor` and `h5replay learner`, against a real server.

The gymnasium actor must stream exactly the episodes the environment produced (replayed here
with the same seed), whole, and refuse a server whose space is not the environment's; the
learner must report on what it samples, wait for a server that is not up yet, and give up on
one that never comes. Skipped without gymnasium (pip install 'h5replay[gym]').
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq
from service_helpers import (
    EPISODE_SPACE,
    SPAWN,
    endpoint,
    processes,
    read_file,
    running_server,
    server_config,
    wait_until,
)

gym = pytest.importorskip("gymnasium")

from h5replay.client import ActorClient, LearnerClient  # noqa: E402
from h5replay.errors import ConfigError, SpaceMismatchError  # noqa: E402
from h5replay.examples.gym_actor import (  # noqa: E402
    PIXELS_SHAPE,
    _stream_episode,
    gym_row_space,
    make_env,
    run_actor,
    space_json,
)
from h5replay.examples.learner import run_learner  # noqa: E402
from h5replay.server import ServerProcess  # noqa: E402
from h5replay.spaces import space_from_json  # noqa: E402

DOCKER = Path(__file__).resolve().parents[2] / "docker"
CARTPOLE = space_from_json(json.loads((DOCKER / "cartpole-space.json").read_text()))


def replay_episodes(env_id: str, seed: int, episodes: int) -> list[dict[str, np.ndarray]]:
    """The episodes `run_actor(seed=seed)` streams, computed again here: same env, same seeds."""
    env = gym.make(env_id)
    env.action_space.seed(seed)
    out = []
    for e in range(episodes):
        obs, _ = env.reset(seed=seed if e == 0 else None)
        rows: dict[str, list] = {k: [] for k in ("obs", "action", "reward", "terminated", "truncated")}
        while True:
            action = env.action_space.sample()
            next_obs, reward, terminated, truncated, _ = env.step(action)
            for key, value in zip(rows, (obs, action, reward, terminated, truncated)):
                rows[key].append(value)
            if terminated or truncated:
                break
            obs = next_obs
        out.append({k: np.asarray(v) for k, v in rows.items()})
    env.close()
    return out


# ----------------------------------------------------------------------------------- spaces


def test_the_shipped_cartpole_space_is_what_space_json_makes():
    assert space_json("CartPole-v1") == json.loads((DOCKER / "cartpole-space.json").read_text())


def test_the_row_space_comes_from_the_environment_spaces():
    env = make_env("CartPole-v1")
    space = gym_row_space(env)
    env.close()
    assert sorted(space.keys()) == ["action", "obs", "reward", "terminated", "truncated"]
    assert space["obs"].shape == (4,) and space["obs"].dtype == np.float32
    assert space["action"].shape == () and space["action"].dtype == np.int64  # Discrete(2)
    assert (int(space["action"].low), int(space["action"].high)) == (0, 1)


def test_a_missing_gymnasium_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "gymnasium", None)  # `import gymnasium` now raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'h5replay\[gym\]'"):
        make_env("CartPole-v1")


def test_an_unknown_environment_is_a_config_error():
    with pytest.raises(ConfigError, match="NoSuchEnv-v0"):
        make_env("NoSuchEnv-v0")


# ------------------------------------------------------------------------------------ actor


def test_the_actor_streams_exactly_the_episodes_the_environment_produced(start_server, tmp_path):
    server = start_server(space=CARTPOLE)
    assert run_actor(server.endpoint, episodes=4, seed=7, timeout=10) == 0
    server.stop(timeout=20)
    segments, rows = read_file(tmp_path / "rb.h5")
    expected = replay_episodes("CartPole-v1", 7, 4)
    assert [n for _, n in segments] == [len(e["reward"]) for e in expected]
    for (start, n), episode in zip(segments, expected):
        for key in episode:
            np.testing.assert_array_equal(rows[key][start:start + n], episode[key], err_msg=key)
        done = rows["terminated"][start:start + n] | rows["truncated"][start:start + n]
        assert done[-1] and not done[:-1].any()


def test_the_actor_stores_each_episodes_final_observation_for_a_server_that_keeps_them(start_server, tmp_path):
    from h5replay.storage import ReplayBuffer

    server = start_server(space=CARTPOLE, observation_keys=("obs",))
    assert run_actor(server.endpoint, episodes=3, seed=5, timeout=10) == 0
    server.stop(timeout=20)
    env = gym.make("CartPole-v1")  # the final observations, computed again: same seeds
    env.action_space.seed(5)
    finals = []
    for e in range(3):
        env.reset(seed=5 if e == 0 else None)
        while True:
            next_obs, _, terminated, truncated, _ = env.step(env.action_space.sample())
            if terminated or truncated:
                finals.append(next_obs)
                break
    env.close()
    with ReplayBuffer.load_from(tmp_path / "rb.h5") as rb:
        episodes = rb.episodes()
        assert len(episodes) == 3
        for ep, final in zip(episodes, finals):
            np.testing.assert_array_equal(rb.final_observation(ep.episode_id), final.astype(np.float32))
        batch = rb.sample_transitions(64, n_step=1, gamma=0.9)
        assert np.all(batch["discount"] == np.float32(0.9)), "every step bootstraps: the last from its final"


def test_the_actor_refuses_a_server_with_another_space(start_server):
    server = start_server(space=EPISODE_SPACE)
    with pytest.raises(SpaceMismatchError) as info:
        run_actor(server.endpoint, episodes=1, timeout=10)
    message = str(info.value)
    assert "'obs'" in message and "float32" in message  # names the field and both sides
    assert "h5replay space gym CartPole-v1" in message  # and the remedy
    with LearnerClient(server.endpoint, timeout=10) as learner:
        assert learner.info()["length"] == 0


def test_a_stop_request_cuts_the_episode_as_truncated_and_commits_it(start_server, tmp_path):
    server = start_server(space=CARTPOLE)
    env = make_env("CartPole-v1")
    stop = threading.Event()
    stop.set()  # as SIGTERM would: the very first step becomes the last
    with ActorClient(server.endpoint, timeout=10) as client:
        steps, _ = _stream_episode(env, client, stop, seed=1)
    env.close()
    server.stop(timeout=20)
    segments, rows = read_file(tmp_path / "rb.h5")
    assert steps == 1 and segments == [(0, 1)]
    assert rows["truncated"].tolist() == [True] and rows["terminated"].tolist() == [False]


def _actor_process(endpoint: str, **kwargs) -> None:
    sys.exit(run_actor(endpoint, **kwargs))


def test_sigterm_ends_an_actor_cleanly_with_only_whole_episodes(start_server, tmp_path):
    server = start_server(space=CARTPOLE)
    with processes() as procs, LearnerClient(server.endpoint, timeout=10) as learner:
        actor = SPAWN.Process(target=_actor_process, args=(server.endpoint,), kwargs={"timeout": 10})
        procs.append(actor)
        actor.start()
        assert wait_until(lambda: learner.info()["num_episodes"] >= 20, 60)
        os.kill(actor.pid, signal.SIGTERM)
        actor.join(30)
        assert actor.exitcode == 0
        stats = learner.info()
    assert stats["aborts"] == 0 and stats["open_segments"] == 0
    server.stop(timeout=20)
    segments, rows = read_file(tmp_path / "rb.h5")
    assert len(segments) >= 20 and sum(n for _, n in segments) == len(rows["reward"])
    for start, n in segments:
        done = rows["terminated"][start:start + n] | rows["truncated"][start:start + n]
        assert done[-1] and not done[:-1].any()


def test_pixel_observations_are_downscaled_frames(start_server, tmp_path, monkeypatch):
    pytest.importorskip("pygame")
    monkeypatch.setenv("SDL_VIDEODRIVER", "dummy")
    space = space_from_json(space_json("CartPole-v1", pixels=True))
    assert space["obs"].shape == (*PIXELS_SHAPE, 3) and space["obs"].dtype == np.uint8
    server = start_server(space=space)
    assert run_actor(server.endpoint, episodes=2, seed=3, timeout=10, pixels=True) == 0
    server.stop(timeout=20)
    segments, rows = read_file(tmp_path / "rb.h5")
    frames = rows["obs"]
    assert len(segments) == 2 and frames.shape[1:] == (*PIXELS_SHAPE, 3)
    assert frames.min() < frames.max()  # a picture, not a blank
    assert not np.array_equal(frames[0], frames[segments[0][1] - 1])  # and the cart moved


# ---------------------------------------------------------------------------------- learner


def test_the_learner_reports_rows_episodes_returns_and_fields(start_server):
    server = start_server(space=CARTPOLE)
    run_actor(server.endpoint, episodes=5, seed=1, timeout=10)
    out = io.StringIO()
    # Empty key paths mean no key: compose may pass `--secret-key=` when no secret is mounted.
    assert run_learner(server.endpoint, batch_size=64, seconds=1.5, report_every=0.5, timeout=10, out=out,
                       secret_key="", server_key="") == 0
    text = out.getvalue()
    lengths = [len(e["reward"]) for e in replay_episodes("CartPole-v1", 1, 5)]
    assert f"{sum(lengths):,} rows held" in text and "in 5 episodes" in text
    assert f"mean length {np.mean(lengths):.1f}" in text
    assert f"mean return {np.mean(lengths):.2f} over the last 5" in text  # CartPole: reward 1 per step
    for field in ("obs", "action", "reward", "terminated", "truncated"):
        assert f"\n  {field} " in text
    last = text.strip().splitlines()[-1]
    assert last.startswith("learner done:") and not last.startswith("learner done: 0 batches")


@pytest.mark.serial  # the learner runs 6 s, in which a server must start and an actor push 3 episodes
def test_the_learner_waits_for_a_server_that_comes_up_later_and_for_data(tmp_path):
    # A fixed port (not port 0): the learner dials it before the server exists.
    config = server_config(tmp_path / "rb.h5", space=CARTPOLE, bind=endpoint(), read_bind=endpoint())
    out = io.StringIO()
    result: list[int] = []
    learner = threading.Thread(target=lambda: result.append(run_learner(
        config.bind, batch_size=32, seconds=6, report_every=0.5, timeout=2, out=out)))
    learner.start()
    try:
        time.sleep(1.0)  # the learner is already trying
        with running_server(config):
            time.sleep(0.5)  # and now it finds an empty buffer
            run_actor(config.bind, episodes=3, seed=2, timeout=10)
            learner.join(30)
    finally:
        learner.join(30)
    assert result == [0]
    assert "in 3 episodes" in out.getvalue() and "learner done: 0 batches" not in out.getvalue()


def test_actor_and_learner_prove_themselves_with_curve_keys(start_server, tmp_path):
    from h5replay.server.auth import generate_keys

    keys = tmp_path / "keys"
    generate_keys(keys)
    server = start_server(space=CARTPOLE, auth_dir=str(keys))
    assert run_actor(server.endpoint, episodes=2, seed=4, timeout=10,
                     secret_key=str(keys / "actor.key_secret"), server_key=str(keys / "server.key")) == 0
    out = io.StringIO()
    assert run_learner(server.endpoint, seconds=1.0, report_every=0.5, timeout=10, out=out,
                       secret_key=str(keys / "learner.key_secret"), server_key=str(keys / "server.key")) == 0
    assert "in 2 episodes" in out.getvalue()


def test_the_learner_gives_up_on_a_server_that_never_answers():
    started = time.monotonic()
    assert run_learner(endpoint(), seconds=1.0, timeout=0.5, out=io.StringIO()) == 1
    assert time.monotonic() - started < 10


# -------------------------------------------------------------------------------------- CLI


def test_space_gym_prints_the_shipped_space_file():
    done = subprocess.run([sys.executable, "-m", "h5replay", "space", "gym", "CartPole-v1"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == json.loads((DOCKER / "cartpole-space.json").read_text())


@pytest.mark.timeout(120)
def test_sigterm_stops_a_learner_at_once_while_it_waits_on_a_server_that_went_away(tmp_path):
    """Compose stops the learner with SIGTERM and SIGKILLs it 30 s later; a request to a server that
    went away waits out the learner's whole --timeout (30 s too), so the signal must cut it short."""
    config = server_config(tmp_path / "rb.h5", space=CARTPOLE)
    server = ServerProcess(config, timeout=60)
    out, err = tmp_path / "learner.out", tmp_path / "learner.err"
    learner = None
    try:
        run_actor(server.endpoint, episodes=3, seed=1, timeout=10)
        with open(out, "wb") as stdout, open(err, "wb") as stderr:
            learner = subprocess.Popen([sys.executable, "-m", "h5replay", "learner", server.endpoint, "--timeout", "30",
                                        "--report-every", "0.5"], stdout=stdout, stderr=stderr)
        assert wait_until(lambda: "batches so far" in out.read_text(), 60), err.read_text()
        server.kill()  # no reply will ever come to the learner's next request
        time.sleep(1.5)
        assert learner.poll() is None  # still waiting
        started = time.monotonic()
        learner.send_signal(signal.SIGTERM)
        assert learner.wait(10) == 0, err.read_text()
        assert time.monotonic() - started < 5
    finally:
        if learner is not None and learner.poll() is None:
            learner.kill()
            learner.wait(10)
        server.kill()
    assert "stopped by a signal" in err.read_text()
    assert out.read_text().strip().splitlines()[-1].startswith("learner done:")


# ------------------------------------------------------------- a stop signal, whatever the server does

_STOP_WITHIN = 2.0  # seconds from SIGTERM / Ctrl-C to the example's exit, whatever the server does


def _example(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[bytes], Path, Path]:
    out, err = tmp_path / f"{args[0]}.out", tmp_path / f"{args[0]}.err"
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "h5replay", *args, "--timeout", "30"], stdout=stdout,
                                stderr=stderr)
    return proc, out, err


def _stopped_within(proc: subprocess.Popen[bytes], sig: int, err: Path) -> float:
    """Send `sig`; the seconds until the process exited (it must exit 0)."""
    assert proc.poll() is None, err.read_text()  # still blocked on the server
    started = time.monotonic()
    proc.send_signal(sig)
    code = proc.wait(30)
    took = time.monotonic() - started
    assert code == 0, err.read_text()
    return took


@contextlib.contextmanager
def _example_against(tmp_path: Path, what: str, server_fate: str, sig: int) -> Iterator[tuple[float, Path]]:
    """Run the example actor or learner against a real server, do `server_fate` to the server
    ("stop": SIGSTOP, "kill": SIGKILL) once data flows, wait until the example is blocked on it, then
    send `sig`; yields (seconds to exit, stderr path)."""
    server = ServerProcess(server_config(tmp_path / "rb.h5", space=CARTPOLE), timeout=60)
    proc = None
    try:
        if what == "learner":
            run_actor(server.endpoint, episodes=3, seed=1, timeout=10)
            proc, out, err = _example(tmp_path, "learner", server.endpoint, "--report-every", "0.2")
            assert wait_until(lambda: "batches so far" in out.read_text(), 60), err.read_text()
        else:
            proc, out, err = _example(tmp_path, "actor", server.endpoint)
            with LearnerClient(server.endpoint, timeout=10) as watch:
                assert wait_until(lambda: watch.info()["num_episodes"] >= 3, 60), err.read_text()
        os.kill(server.pid, signal.SIGSTOP if server_fate == "stop" else signal.SIGKILL)
        time.sleep(1.0)  # the example now waits for a reply that does not come
        yield _stopped_within(proc, sig, err), err
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if server.process.is_alive():
            os.kill(server.pid, signal.SIGCONT)
            server.kill()


@pytest.mark.serial  # exits within _STOP_WITHIN of a signal: 2.17 s once beside 4 workers at load 8
@pytest.mark.timeout(120)
@pytest.mark.parametrize("server_fate", ["stop", "kill"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_the_actor_exits_within_2_s_of_a_signal_while_its_server_is_stopped_or_gone(tmp_path, server_fate, sig):
    with _example_against(tmp_path, "actor", server_fate, sig) as (took, err):
        assert took < _STOP_WITHIN, (took, err.read_text())
    assert "stopped by a signal" in err.read_text()


@pytest.mark.serial  # exits within _STOP_WITHIN of a signal (see the actor test above)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_the_learner_exits_within_2_s_of_a_signal_while_its_server_is_stopped(tmp_path, sig):
    with _example_against(tmp_path, "learner", "stop", sig) as (took, err):
        assert took < _STOP_WITHIN, (took, err.read_text())


@pytest.mark.serial  # exits within _STOP_WITHIN of a signal (see the actor test above)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("what", ["actor", "learner"])
def test_the_examples_exit_within_2_s_of_sigterm_while_a_server_never_answers(tmp_path, what):
    """Something listens on the endpoint and never answers: the hello waits out --timeout (30 s)
    unless the signal cuts it short."""
    mute = zmq.Context.instance().socket(zmq.ROUTER)
    mute.linger = 0
    port = mute.bind_to_random_port("tcp://127.0.0.1")
    proc = None
    try:
        proc, _, err = _example(tmp_path, what, f"tcp://127.0.0.1:{port}")
        assert wait_until(lambda: mute.poll(0, zmq.POLLIN) != 0, 30)  # its hello arrived
        time.sleep(0.5)
        took = _stopped_within(proc, signal.SIGTERM, err)
        assert took < _STOP_WITHIN, (took, err.read_text())
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        mute.close(0)

"""gymnasium meets h5replay: spaces both ways (MultiDiscrete, MultiBinary, Tuple, nested Dict), and
`RecordEpisodes(env, actor)` committing real CartPole episodes to a real server, with their
final observations, from one env and from vector envs in every autoreset mode."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

gym = pytest.importorskip("gymnasium")

from gymnasium import spaces as gs  # noqa: E402
from gymnasium.vector import AutoresetMode  # noqa: E402

from h5replay.client import ActorClient, LearnerClient  # noqa: E402
from h5replay.errors import ConfigError, SpaceMismatchError  # noqa: E402
from h5replay.integrations.gym import (  # noqa: E402
    RecordEpisodes,
    row_space,
    space_from_gymnasium,
    space_to_gymnasium,
    value_from_gymnasium,
    value_to_gymnasium,
)
from h5replay.spaces import BoxSpace, DictSpace  # noqa: E402

pytestmark = pytest.mark.timeout(120)

NESTED = gs.Dict({
    "image": gs.Box(0, 255, (4, 4, 3), np.uint8),
    "joints": gs.MultiDiscrete([3, 5, 2], start=[0, -2, 1]),
    "contacts": gs.MultiBinary(4),
    "task": gs.Tuple((gs.Discrete(4, start=1), gs.Box(-1.0, 1.0, (2,), np.float32),
                      gs.Dict({"goal": gs.Discrete(3), "grid": gs.MultiBinary([2, 2])}))),
    "note": gs.Text(8),
})


def test_spaces_convert_both_ways_and_samples_round_trip() -> None:
    space = space_from_gymnasium(NESTED)
    assert isinstance(space["task"], DictSpace) and list(space["task"].keys()) == ["0", "1", "2"]
    assert space["joints"] == BoxSpace(np.array([0, -2, 1]), np.array([2, 2, 2]), (3,), np.int64)
    assert space_to_gymnasium(space) == NESTED
    NESTED.seed(0)
    for _ in range(20):
        sample = NESTED.sample()
        stored = value_from_gymnasium(NESTED, sample)
        assert space.contains(stored), stored
        back = value_to_gymnasium(NESTED, stored)
        assert isinstance(back["task"], tuple) and back["task"][0] == sample["task"][0]
        np.testing.assert_array_equal(back["joints"], sample["joints"])
        np.testing.assert_array_equal(back["task"][2]["grid"], sample["task"][2]["grid"])


def test_a_space_an_adapter_cannot_map_is_named_where_it_is() -> None:
    with pytest.raises(ConfigError, match=r"Sequence at the space\['a'\]\[1\]"):
        space_from_gymnasium(gs.Dict({"a": gs.Tuple((gs.Discrete(2), gs.Sequence(gs.Discrete(2))))}))
    with pytest.raises(ConfigError, match="cannot convert"):
        space_to_gymnasium("obs")  # type: ignore[arg-type]


def cartpole_server(start_server: Any, name: str = "rb.h5") -> Any:
    env = gym.make("CartPole-v1")
    try:
        space = row_space(env.observation_space, env.action_space)
    finally:
        env.close()
    return start_server(name, space=space, capacity=20_000, observation_keys=("obs",))


def check_episodes(endpoint: str, committed: int) -> int:
    """Every stored episode is a real CartPole episode: consecutive steps chain (a step's next
    observation is the following step's), the end flags sit on the last step only, and a
    terminated episode's final observation is the terminal state (past CartPole's bounds), never
    the next episode's reset observation. Returns the rows held."""
    with LearnerClient(endpoint, timeout=10) as learner:
        episodes = learner.episodes()
        assert len(episodes) == committed
        batch, info = learner.sample_transitions(4000, n_step=1, with_info=True, seed=0)
        rows = learner.get_rows(np.arange(len(learner)))
        ends = {ep.first_row_id + ep.length - 1 for ep in episodes}
        for i, row in enumerate(info.row_ids.astype(np.int64)):
            if row not in ends:
                np.testing.assert_array_equal(batch["next"]["obs"][i], rows["obs"][row + 1])
                assert not batch["terminated"][i] and not batch["truncated"][i]
            elif batch["terminated"][i]:
                x, _, theta, _ = batch["next"]["obs"][i]
                assert abs(x) > 2.4 or abs(theta) > 0.2094, "the final observation is the terminal state"
                assert info.has_final[i] and batch["discount"][i] > 0
        assert ends <= set(info.row_ids.astype(np.int64).tolist()), "every episode's last step is drawn"
        return len(learner)


def test_record_episodes_commits_each_episode_with_its_final_observation(start_server: Any) -> None:
    server = cartpole_server(start_server)
    with ActorClient(server.endpoint, timeout=10) as actor:
        env = RecordEpisodes(gym.make("CartPole-v1"), actor)
        env.action_space.seed(1)
        steps = 0
        for episode in range(5):
            env.reset(seed=episode)
            done = False
            while not done:
                _, _, terminated, truncated, _ = env.step(env.action_space.sample())
                steps += 1
                done = terminated or truncated
        env.reset(seed=9)  # an episode left part-way by close(): committed as cut, without a final
        for _ in range(3):
            env.step(env.action_space.sample())
        env.close()
        assert env.episodes_committed == 6
    assert check_episodes(server.endpoint, 6) == steps + 3


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP])
def test_a_vector_env_records_one_segment_per_sub_env(start_server: Any, mode: Any) -> None:
    server = cartpole_server(start_server)
    with ActorClient(server.endpoint, timeout=10) as actor:
        envs = RecordEpisodes(gym.make_vec("CartPole-v1", num_envs=3, vectorization_mode="sync",
                                           vector_kwargs={"autoreset_mode": mode}), actor)
        envs.reset(seed=3)
        envs.action_space.seed(3)
        ended, stepped = 0, 0
        resetting = np.zeros(3, bool)
        for _ in range(200):
            _, _, terminated, truncated, _ = envs.step(envs.action_space.sample())
            done = terminated | truncated
            stepped += int((~resetting).sum()) if mode is AutoresetMode.NEXT_STEP else 3
            ended += int(done.sum())
            resetting = done if mode is AutoresetMode.NEXT_STEP else resetting
        open_episodes = sum(1 for e in envs._episodes if e.segment is not None)
        envs.close()
        assert envs.episodes_committed == ended + open_episodes and ended >= 10
    assert check_episodes(server.endpoint, ended + open_episodes) == stepped


def test_a_server_of_another_space_is_refused_before_any_step(start_server: Any) -> None:
    server = start_server(space=DictSpace({"x": BoxSpace(0, 1, (), np.float32)}), capacity=10)
    with ActorClient(server.endpoint, timeout=10) as actor:
        with pytest.raises(SpaceMismatchError, match="row_space"):
            RecordEpisodes(gym.make("CartPole-v1"), actor)
        with pytest.raises(SpaceMismatchError, match="row_space"):
            RecordEpisodes(gym.make_vec("CartPole-v1", num_envs=2), actor)

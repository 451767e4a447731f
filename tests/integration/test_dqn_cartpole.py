"""A DQN learns CartPole-v1 from transitions drawn through a real server (issue 24, "transitions").

The test process is both actor and learner. It acts in a gymnasium CartPole-v1 with the current
Q-network (epsilon-greedy), commits each finished episode with its final observation (an
ActorClient over 127.0.0.1), and takes one gradient step per environment step on a batch of
3-step transitions from `H5ReplayDataset(transitions=True)`, whose target is
`reward + discount * (1 - terminated) * max_a Q_target(next.obs, a)`. The greedy policy must
average a return of at least 475 (CartPole-v1's threshold of solved; 500 is the most an episode
gives) over 10 evaluation episodes within `STEP_BUDGET` environment steps (evaluated every
`EVAL_EVERY`). Torch, numpy and the environment are seeded; the server's
draws are not (the dataset samples ahead in a thread, so which rows a batch holds depends on
timing), so the budget leaves room: seeds 0, 1 and 2 reached 500 after 9,000, 13,000 and 20,000 steps.

Skipped when PyTorch or gymnasium is not installed: `make test-torch` runs it.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gymnasium")

from torch import nn  # noqa: E402

from h5replay.client import ActorClient, LearnerClient  # noqa: E402
from h5replay.examples.gym_actor import gym_row_space, make_env  # noqa: E402
from h5replay.integrations.torch import H5ReplayDataset  # noqa: E402
from h5replay.storage import ReplayBuffer  # noqa: E402

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

SEED = 0
STEP_BUDGET = 40_000  # environment steps (training episodes only; evaluation steps are not counted)
EVAL_EVERY = 1_000  # environment steps between greedy evaluations, from WARMUP on
EVAL_EPISODES = 10
TARGET_RETURN = 475.0  # CartPole-v1 counts as solved at 475 (its reward_threshold)

WARMUP = 1_000  # random steps before the first gradient step
EPSILON_START, EPSILON_END, EPSILON_STEPS = 1.0, 0.05, 10_000  # linear decay over the first steps
N_STEP, GAMMA, BATCH_SIZE = 3, 0.99, 64
LEARNING_RATE = 1e-3
TARGET_EVERY = 500  # gradient steps between copies of the online network into the target network


def q_network() -> Any:
    return nn.Sequential(nn.Linear(4, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 2))


def greedy_action(net: Any, obs: np.ndarray) -> int:
    with torch.no_grad():
        return int(net(torch.as_tensor(obs).unsqueeze(0)).argmax(dim=1).item())


def evaluate(net: Any, env: Any, seed: int) -> float:
    """The mean return of `EVAL_EPISODES` greedy episodes (not stored), each reset with its own seed."""
    returns = []
    for episode in range(EVAL_EPISODES):
        obs, _ = env.reset(seed=seed + episode)
        total, done = 0.0, False
        while not done:
            obs, reward, terminated, truncated, _ = env.step(greedy_action(net, obs))
            total += float(reward)
            done = terminated or truncated
        returns.append(total)
    return float(np.mean(returns))


class Tally:
    """What the learner saw: terminal transitions drawn, and the env steps and wall time to the target."""

    def __init__(self) -> None:
        self.terminal_draws = 0  # drawn rows with terminated = 1 and discount > 0
        self.truncated_episodes = 0  # committed episodes cut by the 500-step limit
        self.evaluations: list[tuple[int, float]] = []  # (env steps, mean greedy return)
        self.steps_to_target: int | None = None
        self.seconds = 0.0


def train_dqn(endpoint: str, seed: int) -> Tally:
    """Act, commit and learn until the greedy policy averages `TARGET_RETURN` or `STEP_BUDGET` runs out."""
    started = time.monotonic()
    torch.set_num_threads(1)  # small networks: more threads only contend with the server for 2 cores
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    env, eval_env = make_env("CartPole-v1"), make_env("CartPole-v1")
    env.action_space.seed(seed)
    online, target = q_network(), q_network()
    target.load_state_dict(online.state_dict())
    optimizer = torch.optim.Adam(online.parameters(), lr=LEARNING_RATE)
    dataset = H5ReplayDataset(endpoint, BATCH_SIZE, transitions=True, n_step=N_STEP, gamma=GAMMA, timeout=30)
    tally, batches, updates = Tally(), None, 0
    obs, _ = env.reset(seed=seed)
    rows: list[dict[str, Any]] = []
    try:
        with ActorClient(endpoint, timeout=10) as actor:
            assert actor.keeps_finals, "the server must keep final observations (observation_keys)"
            for step in range(1, STEP_BUDGET + 1):
                epsilon = max(EPSILON_END, EPSILON_START - (EPSILON_START - EPSILON_END) * step / EPSILON_STEPS)
                if step <= WARMUP or rng.random() < epsilon:
                    action = int(env.action_space.sample())
                else:
                    action = greedy_action(online, obs)
                next_obs, reward, terminated, truncated, _ = env.step(action)
                rows.append({"obs": obs, "action": np.asarray(action, np.int64),
                             "reward": np.asarray(reward, np.float32),
                             "terminated": np.asarray(bool(terminated)), "truncated": np.asarray(bool(truncated))})
                obs = next_obs
                if terminated or truncated:  # commit the episode with the observation after its last step
                    episode = {key: np.stack([row[key] for row in rows]) for key in rows[0]}
                    actor.push_episode(episode, final=next_obs)
                    tally.truncated_episodes += int(bool(truncated) and not terminated)
                    rows = []
                    obs, _ = env.reset()

                if step > WARMUP:
                    if batches is None:  # the first episodes are committed by now (a random one is short)
                        batches = iter(dataset)
                    batch = next(batches)
                    terminal = batch["terminated"].float()
                    tally.terminal_draws += int(((terminal > 0) & (batch["discount"] > 0)).sum())
                    with torch.no_grad():
                        next_value = target(batch["next"]["obs"]).max(dim=1).values
                        goal = batch["reward"] + batch["discount"] * (1.0 - terminal) * next_value
                    q = online(batch["obs"]).gather(1, batch["action"].long().unsqueeze(1)).squeeze(1)
                    loss = nn.functional.smooth_l1_loss(q, goal)
                    optimizer.zero_grad()
                    loss.backward()
                    nn.utils.clip_grad_norm_(online.parameters(), 10.0)
                    optimizer.step()
                    updates += 1
                    if updates % TARGET_EVERY == 0:
                        target.load_state_dict(online.state_dict())

                if step > WARMUP and step % EVAL_EVERY == 0:
                    mean_return = evaluate(online, eval_env, seed=10_000 + seed * 100)
                    tally.evaluations.append((step, mean_return))
                    if mean_return >= TARGET_RETURN:
                        tally.steps_to_target = step
                        break
    finally:
        if batches is not None:
            batches.close()  # type: ignore[attr-defined]  # a generator: stops the sampling thread
        env.close()
        eval_env.close()
    tally.seconds = time.monotonic() - started
    return tally


@pytest.fixture
def cartpole_server(start_server: Any) -> Any:
    env = make_env("CartPole-v1")
    try:
        space = gym_row_space(env)
    finally:
        env.close()
    return start_server(space=space, capacity=STEP_BUDGET, observation_keys=("obs",))


def test_a_dqn_solves_cartpole_within_the_step_budget(cartpole_server: Any) -> None:
    tally = train_dqn(cartpole_server.endpoint, SEED)
    print(f"seed {SEED}: evaluations {tally.evaluations}; {tally.steps_to_target} env steps to "
          f"{TARGET_RETURN}, {tally.seconds:.1f} s, {tally.truncated_episodes} truncated episodes")
    assert tally.steps_to_target is not None, (
        f"the greedy policy did not average {TARGET_RETURN} within {STEP_BUDGET} env steps: {tally.evaluations}")
    # The targets were built from terminal transitions: terminated = 1 with a discount (no bootstrap).
    assert tally.terminal_draws > 0

    # Every episode kept its final observation, so the last steps of an episode cut by the time
    # limit bootstrap from it: terminated 0, discount > 0.
    with LearnerClient(cartpole_server.endpoint, timeout=10) as learner:
        batch, info = learner.sample_transitions(4096, n_step=N_STEP, gamma=GAMMA, with_info=True, seed=SEED)
    assert info.has_final is not None and info.has_final.all()
    ends = batch["terminated"] | batch["truncated"]
    assert ends.any() and (batch["discount"][ends] > 0).all()
    if tally.truncated_episodes:
        # Every held step, not a sample: one truncated episode's few cut steps are often missed
        # by 4096 draws (p ~ 0.4 with one such episode among 13k steps).
        with ReplayBuffer.load_from(cartpole_server.config.path, read_only=True, multiprocessing=True) as reader:
            every = reader.get_transitions(np.arange(reader.view.begin, reader.view.end), n_step=N_STEP, gamma=GAMMA)
        cut = every["truncated"] & ~every["terminated"]
        assert cut.any() and (every["discount"][cut] > 0).all()

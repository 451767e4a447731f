"""A served CartPole job: one server, two actor processes, one learner, all on loopback.

Each actor runs CartPole-v1 with a random policy and commits every episode, with its final
observation, through `RecordEpisodes`; the learner waits for data, draws n-step transitions and
prints what it saw. Needs gymnasium (`pip install 'h5replay[gym]'`). Finishes in a few seconds and
stops its server (SIGTERM: the file is flushed and closed).
"""

import multiprocessing as mp
import tempfile
from pathlib import Path

import gymnasium as gym
import numpy as np

from h5replay.client import ActorClient, LearnerClient
from h5replay.config import ServerConfig
from h5replay.integrations.gym import RecordEpisodes, row_space
from h5replay.server import ServerProcess

EPISODES_PER_ACTOR = 20


def run_actor(endpoint: str, seed: int) -> None:
    """One actor process: its own client, made here (sockets are never inherited)."""
    with ActorClient(endpoint, name=f"actor-{seed}", timeout=10.0) as actor:
        env = RecordEpisodes(gym.make("CartPole-v1"), actor)
        env.action_space.seed(seed)
        env.reset(seed=seed)
        while env.episodes_committed < EPISODES_PER_ACTOR:
            _, _, terminated, truncated, _ = env.step(env.action_space.sample())
            if terminated or truncated:
                env.reset()
        env.close()


def main() -> None:
    env = gym.make("CartPole-v1")
    space = row_space(env.observation_space, env.action_space)  # obs, action, reward, terminated, truncated
    with tempfile.TemporaryDirectory() as tmp:
        config = ServerConfig(path=str(Path(tmp) / "cartpole.h5"), space=space, capacity=100_000,
                              bind="tcp://127.0.0.1:0", observation_keys=("obs",))  # port 0: any free port
        with ServerProcess(config) as server:  # a spawned process; returns once it serves
            spawn = mp.get_context("spawn")
            actors = [spawn.Process(target=run_actor, args=(server.endpoint, seed)) for seed in (1, 2)]
            for p in actors:
                p.start()
            with LearnerClient(server.endpoint, timeout=10.0) as learner:
                learner.wait_for_size(500, timeout=30)  # warm-up: at least 500 rows held
                for _ in range(10):
                    batch = learner.sample_transitions(64, n_step=3, gamma=0.99)
                    assert batch["obs"].shape == (64, 4) and batch["next"]["obs"].shape == (64, 4)
                for p in actors:
                    p.join(60)
                episodes = learner.episodes()
                lengths = [e.length for e in episodes]
                print(f"{len(learner)} rows in {len(episodes)} episodes, mean length {np.mean(lengths):.1f}")
                print("n-step returns of the last batch: mean", float(batch["reward"].mean()))
        # leaving the block stopped the server: the file is closed and complete


if __name__ == "__main__":
    main()

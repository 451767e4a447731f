"""Prioritized replay over the wire: actors give priorities, the learner weights and updates them.

A server whose one table samples rows in proportion to priority ** 0.6 (Schaul et al. 2016). The
actor pushes episodes with a priority per step; the learner draws batches with their
probabilities, turns them into importance weights, and sends new priorities back (here: made up,
where a real learner would send its TD errors). Finishes in a few seconds.
"""

import tempfile
from pathlib import Path

import numpy as np

from h5replay.client import ActorClient, LearnerClient
from h5replay.config import ServerConfig
from h5replay.server import ServerProcess
from h5replay.storage import BoxSpace, DictSpace, Prioritized, Table


def main() -> None:
    space = DictSpace({"obs": BoxSpace(-1, 1, (4,)), "reward": BoxSpace(-1, 1, ())})
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        config = ServerConfig(path=str(Path(tmp) / "per.h5"), space=space, capacity=10_000, bind="tcp://127.0.0.1:0",
                              tables={"replay": Table(Prioritized(exponent=0.6))})
        with ServerProcess(config) as server:
            with ActorClient(server.endpoint) as actor:
                for _ in range(20):
                    episode = {"obs": rng.uniform(-1, 1, (50, 4)), "reward": rng.uniform(-1, 1, 50)}
                    actor.push_episode(episode, priorities=np.abs(episode["reward"]) + 0.01)
            with LearnerClient(server.endpoint) as learner:
                for _ in range(20):
                    batch, info = learner.sample(128, with_info=True)
                    weights = info.importance_weights(beta=0.4)  # (N * P(i)) ** -beta, the largest 1
                    td_errors = np.abs(batch["reward"]) * rng.uniform(0.5, 1.5, 128)  # stands in for |target - Q(s, a)|
                    loss = float(np.mean(weights * td_errors ** 2))  # the weighted loss a learner would minimise
                    learner.update_priorities(info.row_ids, td_errors + 0.01, wait=False)  # sent in the background
                learner.flush_priorities()  # wait for the updates still on their way
                print(f"{len(learner)} rows; last batch: loss {loss:.3f}, probabilities {info.probabilities.min():.2e}.."
                      f"{info.probabilities.max():.2e}, weights {weights.min():.2f}..{weights.max():.2f}")


if __name__ == "__main__":
    main()

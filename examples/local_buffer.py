"""A local replay buffer in one file: ten episodes in, a batch out (no server, no sockets)."""

import numpy as np

from h5replay.storage import BoxSpace, DictSpace, ReplayBuffer

space = DictSpace({"obs": BoxSpace(-1, 1, (4,)), "action": BoxSpace(0, 1, (), np.int64), "reward": BoxSpace(-10, 10, ())})

if __name__ == "__main__":
    with ReplayBuffer.create(space, capacity=10_000, cache_path="local_buffer.h5") as rb:
        for _ in range(10):  # an episode is a dict of arrays with a leading axis of steps
            rb.extend({"obs": np.random.uniform(-1, 1, (50, 4)), "action": np.random.randint(0, 2, 50), "reward": np.ones(50)})
            rb.end_episode()
        batch = rb.sample(32)
        print(len(rb), "rows in", len(rb.episodes()), "episodes; a batch of", batch["obs"].shape, batch["obs"].dtype)

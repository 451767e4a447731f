"""Two servers ("shards"), each with its own file: actors stick to a home shard, learners read both.

The shards know nothing of each other; the clients route. An actor writes to the shard its name
hashes to; a learner samples every live shard in proportion to its rows and says where each row
came from. Finishes in a few seconds and stops both servers.
"""

import tempfile
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from h5replay.client import ActorClient, LearnerClient
from h5replay.config import ServerConfig
from h5replay.server import ServerProcess
from h5replay.storage import BoxSpace, DictSpace


def main() -> None:
    space = DictSpace({"obs": BoxSpace(-1, 1, (4,))})  # every shard must hold the same space
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        servers = [stack.enter_context(ServerProcess(ServerConfig(
            path=str(Path(tmp) / f"shard-{k}.h5"), space=space, capacity=10_000, bind="tcp://127.0.0.1:0")))
            for k in range(2)]
        endpoints = [s.endpoint for s in servers]  # the same order in every client
        for name in ("actor-0", "actor-1", "actor-2", "actor-3"):
            with ActorClient(endpoints=endpoints, name=name) as actor:
                for _ in range(5):
                    actor.push_episode({"obs": np.zeros((20, 4))})
                print(name, "writes to shard", actor.shard)
        with LearnerClient(endpoints=endpoints) as learner:
            batch, info = learner.sample(256, with_info=True)
            print(len(learner), "rows over", len(endpoints), "shards; rows drawn per shard:",
                  np.bincount(info.shard_ids, minlength=len(endpoints)).tolist())
            print("a row read back by its packed id:", learner.get_rows(info.packed_row_ids[:1])["obs"].shape)


if __name__ == "__main__":
    main()

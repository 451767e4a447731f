"""Clients over several servers ("shards"): actors that stick to one shard, learners that read all.

Each shard is an ordinary h5replay server owning its own file; shards know nothing of each other
(Reverb's model: no replication, no cross-shard transaction). All routing lives here, in the
client, over the ordinary single-server clients: `ActorClient(endpoints=[...])` and
`LearnerClient(endpoints=[...])` build a `ShardedActor` / `ShardedLearner`, hand it their own
class for the shards' clients (`client_class`: this package never imports the modules that import
it) and delegate to it.

A shard is named by its index in `endpoints` (the same list, in the same order, for every client)
and told apart from the others by its file's `replay_id`. Row and episode ids are qualified by it:
`SampleInfo.shard_ids`, and a packed uint64 ``shard << 48 | id`` (h5replay.records.pack_ids).

Actors: an actor writes to its home shard, a stable hash of its name modulo the number of
shards (`home_shard`: the same in every process and on every machine). When that shard stops
answering, the episode in flight is opened again on the next live shard and every row of it so
far is streamed there again: the client keeps a copy of the episode's rows until its commit is acknowledged (one
extra copy of the current episode in the actor's memory). While away, the actor probes its home
shard in a background thread every `shard_retry_interval` seconds and goes back between two
episodes once it answers. Every episode carries an idempotency key, the same on every retry. A
commit whose reply was lost may or may not have been applied, and a server only knows its own
keys: so the episode goes to no other shard. Its commit is sent again with its key on the same
shard (which answers a commit it applied with the original receipt); when that shard stays
silent past the commit's time, the commit raises CommitInDoubtError and the actor keeps the
episode in memory (`ActorClient.in_doubt`), writes its next episodes to the next live shard, and
settles the kept one on its shard, with its key, once that shard answers again (probed in the
background; settled at the actor's next call, by `settle()`, or at `close()`). Exactly once.

Learners: `sample(n)` splits the batch over the live shards in proportion to the rows each holds
(a multinomial draw, so the union is sampled uniformly), sends one request to every shard at once
(one thread per shard: zmq and numpy release the GIL; on asyncio one task per shard) and puts the answers back together in the
order of the draw. `len`, `info` and `episodes` add the shards up. A shard that does not answer is
skipped with a warning (logged once when it goes down) and counted per call
(`ShardedLearner.num_skipped`); it is probed in the background and used again once it answers.
When no shard answers a call raises ServerUnavailableError.

Drivers: a learner's routing is plans (`Fan`: one call per shard, all at once) that the blocking
router runs with a thread per shard and the asyncio one (h5replay.client.aio,
`AsyncLearnerClient(endpoints=)`) with a task per shard. Threads: the per-shard clients are made in worker threads (initial hellos in parallel, probes in
the background) and then used by whichever thread holds the router's lock; each hand-over goes
through a Future, a full memory barrier, which is what zmq asks of a socket changing threads.
"""

from __future__ import annotations

from h5replay.client._shards._router import MAX_SHARDS, home_shard
from h5replay.client._shards.actor import InDoubt, ShardedActor, ShardedSegment
from h5replay.client._shards.learner import ShardedLearner

__all__ = ["ShardedActor", "ShardedLearner", "ShardedSegment", "InDoubt", "home_shard", "MAX_SHARDS"]

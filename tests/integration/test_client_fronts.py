"""`ActorClient` and `LearnerClient` (and their asyncio twins) are the public faces of two classes each: the client of one
server, and (with `endpoints=`) the front of several, `ShardedActorClient` / `ShardedLearnerClient`,
which route every call through the shard router. No one-server code runs on a sharded front: every
verb is its own, and what a single server has alone (a view, priority updates held back) answers
plainly over shards."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from service_helpers import EPISODE_SPACE, episode_rows
from shard_helpers import running_shards

from h5replay.client import ActorClient, LearnerClient
from h5replay.client.actor import ShardedActorClient
from h5replay.client.aio import AsyncActorClient, AsyncLearnerClient
from h5replay.client.aio.actor import AsyncShardedActorClient
from h5replay.client.aio.learner import AsyncShardedLearnerClient
from h5replay.client.learner import ShardedLearnerClient
from h5replay.errors import ConfigError
from h5replay.sampling import Prioritized, SamplingConfig

pytestmark = pytest.mark.timeout(120)

# Public members the sharded fronts may inherit: they read the figures every shard shares.
ACTOR_SHARED = {"state", "driver", "keeps_finals", "encode_one", "encode_batch", "encode_final", "check_priorities"}
LEARNER_SHARED: set[str] = set()
# The asyncio actor's figures all read its `state`, which the sharded front takes from one shard.
ASYNC_ACTOR_SHARED = {"space", "schema", "limits", "capacity", "keeps_finals", "rows_per_message", "rows_per_push",
                      "commit_timeout", "encode_one", "encode_batch", "encode_final", "check_priorities"}


def public(cls: type) -> set[str]:
    return {name for name in dir(cls) if not name.startswith("_")} | {"__len__"} & set(dir(cls))


@pytest.mark.parametrize(("one", "sharded", "shared"), [
    (ActorClient, ShardedActorClient, ACTOR_SHARED), (LearnerClient, ShardedLearnerClient, LEARNER_SHARED),
    (AsyncLearnerClient, AsyncShardedLearnerClient, LEARNER_SHARED),
    (AsyncActorClient, AsyncShardedActorClient, ASYNC_ACTOR_SHARED)])
def test_every_verb_of_a_sharded_front_is_its_own(one: type, sharded: type, shared: set[str]) -> None:
    inherited = {name for name in public(one) if name not in vars(sharded)} - shared
    assert not inherited, f"{sharded.__name__} would run {one.__name__}'s one-server code for {sorted(inherited)}"
    for name in public(one) & set(vars(sharded)):  # the same arguments, so a user's call means the same
        mine, theirs = getattr(sharded, name), getattr(one, name)
        if callable(mine) and not isinstance(mine, property):
            assert list(inspect.signature(mine).parameters) == list(inspect.signature(theirs).parameters), name


def test_endpoints_make_the_sharded_fronts_and_answer_what_only_one_server_has(tmp_path) -> None:
    sampling = SamplingConfig(Prioritized(exponent=1.0))
    with running_shards(tmp_path, 2, space=EPISODE_SPACE, sampling=sampling) as shards:
        with ActorClient(endpoints=shards.endpoints, name="front-actor") as actor, \
                LearnerClient(endpoints=shards.endpoints) as learner:
            assert type(actor) is ShardedActorClient and isinstance(actor, ActorClient)
            assert type(learner) is ShardedLearnerClient and isinstance(learner, LearnerClient)
            pending = actor.push_episode(episode_rows(1, 0, 10), wait=False)
            assert pending.done() and pending.result().length == 10
            actor.flush()
            assert learner.wait_for_size(10, timeout=10) == 10
            batch, info = learner.sample(8, with_info=True)
            assert learner.view is None and len(learner.views) == 2, "each shard has its own view"
            assert learner.update_priorities(info.packed_row_ids, np.ones(8), wait=False) == 0
            learner.flush_priorities()  # nothing is held back over shards
            assert learner.ignored_priority_updates == 0 and learner.shards is not None
        with ActorClient(shards.endpoints[0]) as one, LearnerClient(shards.endpoints[0]) as single:
            assert type(one) is ActorClient and type(single) is LearnerClient and single.shards is None
            assert single.views == (single.view,)


def test_a_sharded_front_without_endpoints_and_a_one_server_subclass_with_them_are_refused() -> None:
    with pytest.raises(ConfigError, match="needs endpoints="):
        ShardedLearnerClient("tcp://127.0.0.1:1")
    with pytest.raises(ConfigError, match="needs endpoints="):
        ShardedActorClient("tcp://127.0.0.1:1")

    with pytest.raises(ConfigError, match="needs endpoints="):
        AsyncShardedLearnerClient("tcp://127.0.0.1:1")
    with pytest.raises(ConfigError, match="needs endpoints="):
        AsyncShardedActorClient("tcp://127.0.0.1:1")

    class MyLearner(LearnerClient):
        pass

    class MyAsyncLearner(AsyncLearnerClient):
        pass

    with pytest.raises(ConfigError, match="MyLearner is the client of one server"):
        MyLearner(endpoints=["tcp://127.0.0.1:1"])
    with pytest.raises(ConfigError, match="MyAsyncLearner is the client of one server"):
        MyAsyncLearner(endpoints=["tcp://127.0.0.1:1"])

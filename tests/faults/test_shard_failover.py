"""A shard SIGKILLed under actors writing across shards: they move on, nothing acknowledged is lost.

Real servers on loopback, actors in their own processes (h5replay.client._shards routes), two of
them blocking `ActorClient`s and two `AsyncActorClient`s (the same routing on asyncio). The
check is on the files themselves, reopened after every server stopped.

An episode whose commit reply was lost in the kill (the commit may have landed before the server
died) is sent again with its idempotency key to the killed shard while the actor's commit budget
lasts; the shard stays down longer here, so its commit raises CommitInDoubtError and the actor
keeps it, writes its next episodes elsewhere, and settles it on the killed shard once that shard
is back. Every acknowledged episode, those settled included, is held exactly once.
"""

from __future__ import annotations

import time

import pytest
from service_helpers import SPAWN, processes, wait_until
from shard_helpers import count_problems, episodes_by_shard, running_shards, sharded_actor_main

from h5replay.client import LearnerClient
from h5replay.client._shards import home_shard
from h5replay.config import ClientConfig

NUM_SHARDS = 3
NUM_ACTORS = 4
EPISODES = 120


@pytest.mark.serial  # the killed shard must be back before the actors finish: a race with the load beside it
@pytest.mark.timeout(180)
def test_actors_fail_over_when_their_shard_is_sigkilled_and_every_acknowledged_episode_is_held_once(tmp_path):
    victim = home_shard("shard-actor-1", NUM_SHARDS)  # the home of actors 1 and 3
    with running_shards(tmp_path, NUM_SHARDS, capacity=200_000) as shards, processes() as procs:
        out = SPAWN.Queue()
        for actor in range(NUM_ACTORS):
            driver = "asyncio" if actor in (0, 1) else "blocking"  # on the victim: 1 asyncio, 3 blocking
            procs.append(SPAWN.Process(target=sharded_actor_main,
                                       args=(shards.endpoints, actor, EPISODES, actor, out, 2.0, 0.05, driver)))
            procs[-1].start()
        with LearnerClient(shards.endpoints[victim], timeout=10) as watch:
            assert wait_until(lambda: len(watch) > 2000, timeout=60), "the victim shard never got rows"
        shards.kill(victim)  # writer and readers, mid-stream
        # Down for longer than an actor's commit budget (commit_attempts x timeout = 3 x 2 s), so
        # the actors homed there move on to the next live shard; then it comes back.
        time.sleep(ClientConfig().commit_attempts * 2.0 + 2.0)
        shards.start(victim)  # the same file and ports: crash recovery, then the actors come back

        results = [out.get(timeout=150) for _ in range(NUM_ACTORS)]
        for proc in procs:
            proc.join(30)
        for i in range(NUM_SHARDS):
            assert shards.stop(i) == 0

    errors = [r for r in results if r[0] != "done"]
    assert not errors, errors
    acknowledged = {(actor, e): n for _, actor, episodes, *_ in results for e, n in episodes}
    in_doubt = {(actor, e) for _, actor, _, doubted, *_ in results for e in doubted}
    assert len(acknowledged) == NUM_ACTORS * EPISODES  # the episodes in doubt were all settled

    found, problems = episodes_by_shard(shards.paths)
    assert problems == [], problems[:10]  # every episode held is whole, nothing partial is visible
    # Exactly once, the episodes whose commit was in flight when their shard died included: kept
    # by their actor past the commit budget and settled on that shard (never pushed elsewhere).
    problems = count_problems(acknowledged, found)
    assert problems == [], problems[:10]
    assert len(in_doubt) <= NUM_ACTORS, in_doubt  # at most one commit in flight per actor
    assert all(s == victim for s, a, e in found if (a, e) in in_doubt), in_doubt

    # The actors whose home was killed moved on, and came back home after the restart.
    homed = [r for r in results if r[4] == victim]
    moved = [r for r in homed if r[5] >= 1]
    assert moved == homed, [r[4:] for r in results]
    for _, a, *_ in moved:
        last_on = {s: max(e for s2, actor, e in found if actor == a and s2 == s)
                   for s in {s for s, actor, _ in found if actor == a}}
        assert len(last_on) >= 2 and max(last_on, key=last_on.get) == victim, (a, last_on)  # home again at the end
    # Actors of the other shards never moved.
    assert all(r[5] == 0 for r in results if r[4] != victim), [r[4:] for r in results]

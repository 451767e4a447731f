"""The sans-I/O core of a learner's reads: requests built, replies folded, no socket, no lock.

Each verb is a *plan*, a generator that yields operations (`ops.py`: send this request, wait
for that reply, forget one, sleep, read the clock, hand a batch to the caller) and is sent back
their results; it returns the verb's result. A driver runs plans: the blocking one
(`h5replay.client._drive`, under `LearnerClient`) and the asyncio one
(`h5replay.client.aio`, under `AsyncLearnerClient`) only move bytes and wait, so both
fronts share every rule of how a read is split, joined and checked (h11's and pyzmq's
`_future.py` way: the protocol apart from how it waits). Tests drive plans by hand
(tests/unit/test_client_core.py).

Modules, one job each:

- `ops.py`: the operations a plan yields, and error replies turned into exceptions.
- `exchange.py`: several requests at once within the in-flight window; consuming draws that
  never drop a drawn row; replies' leaves joined.
- `state.py`: what a learner knows of its server (limits, tables, the monotonic view, kept rows).
- `reads.py`: info, len, wait_for_size, get, get_rows, episodes, update_priorities.
- `draws.py`: sample, sample_sequences (padded or not), sample_transitions.
- `batches.py`: `batches`, requests kept in flight ahead of the caller.

Nothing here imports zmq, sleeps or reads the clock itself.
"""

from __future__ import annotations

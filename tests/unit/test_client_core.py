"""The client core (h5replay.client._core) without sockets: every plan driven by a script that
answers its requests as a server would, so the splitting of big reads, the in-flight window, the
monotonic view, consuming draws that keep what they drew, and refusals turned into exceptions are
checked in milliseconds."""

from __future__ import annotations

import ast
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import h5replay.client._core as core
from h5replay import protocol as P
from h5replay.client._core import actor as plan_actor
from h5replay.client._core import batches as plan_batches
from h5replay.client._core import draws as plan_draws
from h5replay.client._core import reads as plan_reads
from h5replay.client._core import segments as plan_segments
from h5replay.client._core.exchange import collect, joined, read_many
from h5replay.client._core.ops import (
    READS,
    WRITER,
    Deliver,
    FlushPriorities,
    Forget,
    LoopLeft,
    Now,
    Send,
    Sleep,
    Wait,
    checked,
    finished,
)
from h5replay.client._core.state import LearnerState
from h5replay.client._reads import View
from h5replay.config import ClientConfig
from h5replay.errors import (
    ConfigError,
    DiskFullError,
    EvictedError,
    NotEnoughDataError,
    ProtocolError,
    RateLimitedError,
    SegmentStateError,
    ServerUnavailableError,
)
from h5replay.records import Receipt, SampleInfo
from h5replay.spaces import BoxSpace, DictSpace

pytestmark = pytest.mark.timeout(30)

SPACE = DictSpace({"x": BoxSpace(-np.inf, np.inf, (), np.float32)})
LIMITS = P.Limits(max_rows_per_message=10)
QUEUE = {"sampler": "Fifo", "writer_samples": True, "max_times_sampled": 1}
PRIORITIZED = {"sampler": "Prioritized", "priority_exponent": 0.6}


def make_state(sampling: dict[str, Any] | None = None, *, max_in_flight: int = 4, separate_reads: bool = True,
               limits: P.Limits = LIMITS) -> LearnerState:
    hello = P.HelloReply(1, SPACE.to_json(), 1000, 0, 0, "test", P.PROTOCOL_VERSION, limits, "tcp://127.0.0.1:2",
                         "replay", "instance", sampling or {"sampler": "Uniform"})
    config = ClientConfig(endpoint="tcp://127.0.0.1:1", timeout=1.0, max_in_flight=max_in_flight,
                          rate_limit_timeout=2.0)
    return LearnerState(config, hello, separate_reads=separate_reads)


class Script:
    """Drives a plan as a driver would; `answer(request)` is the server (a reply, or an exception
    to throw at the plan's wait). Records every operation and request."""

    def __init__(self, answer: Callable[[P.Request], Any]) -> None:
        self.answer = answer
        self.ops: list[Any] = []
        self.sent: list[tuple[str, P.Request]] = []
        self.forgotten: list[int] = []
        self.requests: dict[int, P.Request] = {}
        self.clock = 100.0
        self._ids = itertools.count(1)

    def kinds(self) -> list[str]:
        return [type(op).__name__ for op in self.ops]

    def run(self, plan: Any, *, stop_after: int | None = None) -> Any:
        """The plan's result; with `stop_after`, the values delivered until that many came, after
        which the caller leaves the loop (LoopLeft thrown in, swallowed at the end)."""
        value: Any = None
        error: BaseException | None = None
        delivered: list[Any] = []
        while True:
            try:
                op = plan.send(value) if error is None else plan.throw(error)
            except StopIteration as stop:
                return stop.value if stop_after is None else delivered
            except LoopLeft:
                return delivered
            self.ops.append(op)
            value, error = None, None
            if isinstance(op, Send):
                request_id = next(self._ids)
                request = op.request(request_id)
                self.sent.append((op.target, request))
                self.requests[request_id] = request
                value = request_id
            elif isinstance(op, Wait):
                reply = self.answer(self.requests[op.request_id])
                if isinstance(reply, BaseException):
                    error = reply
                else:
                    value = reply
            elif isinstance(op, Forget):
                self.forgotten.append(op.request_id)
            elif isinstance(op, Now):
                value = self.clock
            elif isinstance(op, Sleep):
                self.clock += op.seconds
            elif isinstance(op, Deliver):
                delivered.append(op.value)
                if stop_after is not None and len(delivered) >= stop_after:
                    error = LoopLeft()


def view(seq: int = 1, begin: int = 0, end: int = 1000) -> tuple[int, int, int, int]:
    return seq, 0, begin, end


def rows_reply(request: Any, first: int = 0, seq: int = 1) -> P.SampleReply:
    n = request.batch_size
    ids = np.arange(first, first + n, dtype=np.int64)
    return P.SampleReply(request.request_id, *view(seq), ids, ids.astype(np.uint64), np.full(n, 0.001),
                         {"x": ids.astype(np.float32)})


def refusal(request: Any, error: Exception) -> P.ErrorReply:
    return P.ErrorReply.from_exception(request.request_id, error)


# ------------------------------------------------------------------ ops and folds


def test_the_core_does_no_io_of_its_own() -> None:
    """No module of the core imports what waits or talks: sockets, threads, clocks, event loops."""
    waiting = {"zmq", "socket", "threading", "time", "asyncio", "select", "selectors", "h5py"}
    for path in sorted(Path(core.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            used = {name.split(".")[0] for name in names} & waiting
            assert not used, f"{path.name} imports {sorted(used)}: the core must stay apart from how it waits"


def test_checked_turns_a_refusal_into_its_exception_by_code() -> None:
    with pytest.raises(EvictedError, match="row 3"):
        checked(P.ErrorReply.from_exception(4, EvictedError("row 3 is gone")))
    reply = P.HeartbeatReply(4)
    assert checked(reply) is reply


def test_joined_keeps_one_reply_as_it_came_and_concatenates_several_in_order() -> None:
    one = {"x": np.arange(3)}
    assert joined([one], ["x"])["x"] is one["x"]
    assert joined([one, {"x": np.arange(3, 5)}], ["x"])["x"].tolist() == [0, 1, 2, 3, 4]


def test_a_plan_of_no_operation_returns_its_value() -> None:
    assert Script(lambda r: None).run(finished(7)) == 7


# ------------------------------------------------------------------ splitting and the window


def test_a_big_sample_is_split_into_messages_with_consecutive_seeds_and_joined_in_order() -> None:
    state = make_state()
    starts = iter([0, 100, 200])
    script = Script(lambda r: rows_reply(r, next(starts)))
    batch, info = script.run(plan_draws.sample(state, 25, 3, True, None)).result()
    sent = [r for _, r in script.sent]
    assert [r.batch_size for r in sent] == [10, 10, 5] and [r.seed for r in sent] == [3, 4, 5]
    assert all(target == READS for target, _ in script.sent)
    assert batch["x"].tolist() == [*range(10), *range(100, 110), *range(200, 205)]
    assert info.row_ids.tolist() == batch["x"].astype(int).tolist()


def test_no_more_than_max_in_flight_requests_travel_at_once() -> None:
    state = make_state(max_in_flight=2)
    script = Script(rows_reply)
    script.run(plan_draws.sample(state, 40, None, False, None))
    assert script.kinds() == ["Send", "Send", "Wait", "Send", "Wait", "Send", "Wait", "Wait"]


def test_rows_by_id_are_read_in_messages_of_ids_per_message() -> None:
    state = make_state()
    script = Script(lambda r: P.GetRowsReply(r.request_id, *view(), len(r.row_ids),
                                             {"x": r.row_ids.astype(np.float32)}))
    arrays = script.run(plan_reads.get_rows(state, np.arange(25)[::-1]))
    assert [len(r.row_ids) for _, r in script.sent] == [10, 10, 5]
    assert arrays["x"].tolist() == list(range(24, -1, -1))


@pytest.mark.parametrize("ids, error, match", [
    ([3, -1], IndexError, "negative"),
    (np.array([True, False]), TypeError, "np.flatnonzero"),
    ([0.5], TypeError, "integers"),
])
def test_bad_row_ids_are_refused_before_anything_is_sent(ids: Any, error: type[Exception], match: str) -> None:
    script = Script(lambda r: None)
    with pytest.raises(error, match=match):
        script.run(plan_reads.get_rows(make_state(), ids))
    assert script.sent == []


def test_get_reads_the_first_message_by_index_and_the_rest_by_id_in_the_same_view() -> None:
    state = make_state()

    def answer(r: Any) -> Any:
        if isinstance(r, P.Get):  # 10 rows held, ids 50..59, at publish 7
            return P.GetReply(r.request_id, 7, 0, 50, 60, r.indices + 50, {"x": (r.indices % 10 + 50).astype(np.float32)})
        return P.GetRowsReply(r.request_id, 7, 0, 50, 60, len(r.row_ids), {"x": r.row_ids.astype(np.float32)})

    script = Script(answer)
    arrays = script.run(plan_reads.get(state, [*range(10), -1, 0]))
    assert arrays["x"].tolist() == [*range(50, 60), 59, 50]
    rows = script.sent[1][1]
    assert isinstance(rows, P.GetRows) and rows.min_seq == 7 and rows.row_ids.tolist() == [59, 50]
    with pytest.raises(IndexError, match="index 10 is out of range for 10 rows"):
        Script(answer).run(plan_reads.get(state, [*range(10), 10]))


# ------------------------------------------------------------------ the monotonic view


def test_the_view_never_goes_back_and_every_read_asks_for_the_newest_seen() -> None:
    state = make_state()
    seqs = iter([5, 3])
    script = Script(lambda r: rows_reply(r, seq=next(seqs)))
    script.run(plan_draws.sample(state, 10, None, False, None))
    script.run(plan_draws.sample(state, 10, None, False, None))
    assert state.view is not None and state.view.seq == 5, "an older reply moved the view back"
    script.answer = lambda r: rows_reply(r, seq=6)
    script.run(plan_draws.sample(state, 10, None, False, None))
    assert [r.min_seq for _, r in script.sent] == [0, 5, 5]
    assert state.view.seq == 6


def test_info_asks_the_writer_and_a_reader_and_the_readers_figures_move_the_view() -> None:
    state = make_state()
    stats = {WRITER: {"clients": 2, "length": 1}, READS: {"seq": 9, "length": 40, "oldest_row_id": 10}}
    script = Script(lambda r: P.InfoReply(r.request_id, stats[script.sent[-1][0]]))  # type: ignore[arg-type]
    figures = script.run(plan_reads.info(state))
    assert figures == {"clients": 2, "seq": 9, "length": 40, "oldest_row_id": 10}
    assert state.view == (9, 0, 10, 50)
    assert script.run(plan_reads.length(state)) == 40
    alone = make_state(separate_reads=False)
    Script(lambda r: P.InfoReply(r.request_id, {"seq": 2, "length": 3})).run(plan_reads.info(alone))
    assert alone.view is not None and alone.view.seq == 2


def test_own_priority_updates_are_flushed_before_a_read_and_their_publish_is_asked_for() -> None:
    state = make_state(PRIORITIZED)
    state.updates_pending = lambda: True
    script = Script(rows_reply)
    script.run(plan_draws.sample(state, 5, None, False, None))
    assert isinstance(script.ops[0], FlushPriorities)
    state.updates_pending = lambda: False
    replies = iter([P.UpdatePrioritiesReply(0, 1, 12), P.UpdatePrioritiesReply(0, 2, 11)])
    script = Script(lambda r: next(replies))
    ignored = script.run(plan_reads.update_priorities(state, np.arange(8), np.ones(8), None))
    assert ignored == 3 and [len(r.row_ids) for _, r in script.sent] == [5, 3]  # ids and priorities share a message
    assert all(target == WRITER for target, _ in script.sent)
    assert state.min_seq == 12


def test_priorities_of_a_table_that_keeps_none_are_refused_here() -> None:
    with pytest.raises(ConfigError, match="not by priority"):
        Script(lambda r: None).run(plan_reads.update_priorities(make_state(), [1], [1.0], None))
    with pytest.raises(ConfigError, match="priorit"):
        Script(lambda r: None).run(plan_reads.update_priorities(make_state(PRIORITIZED), [1], [-1.0], None))


# ------------------------------------------------------------------ refusals


def test_a_refused_part_raises_its_exception_and_the_parts_still_travelling_are_forgotten() -> None:
    state = make_state()
    script = Script(lambda r: refusal(r, NotEnoughDataError("nothing yet")) if r.request_id == 1 else rows_reply(r))
    with pytest.raises(NotEnoughDataError, match="nothing yet"):
        script.run(plan_draws.sample(state, 30, None, False, None))
    assert script.forgotten[-2:] == [2, 3]


def test_no_answer_in_time_is_thrown_into_the_plan_which_forgets_the_rest() -> None:
    state = make_state()
    script = Script(lambda r: ServerUnavailableError("no answer") if r.request_id == 2 else rows_reply(r))
    with pytest.raises(ServerUnavailableError):
        script.run(read_many(state, READS, plan_draws.sample_requests(state, 30, None, state.table(None))))
    assert 3 in script.forgotten


def test_the_hello_plan_refuses_an_answer_that_is_no_hello() -> None:
    with pytest.raises(ProtocolError, match="expected a hello reply, got HeartbeatReply"):
        Script(lambda r: P.HeartbeatReply(r.request_id)).run(plan_reads.hello("me"))


# ------------------------------------------------------------------ consuming draws


def test_a_consuming_sample_goes_to_the_writer_and_keeps_the_parts_drawn_before_a_failure() -> None:
    state = make_state(QUEUE)
    script = Script(lambda r: refusal(r, RateLimitedError("held back")) if r.request_id == 2 else rows_reply(r))
    with pytest.raises(RateLimitedError, match="the 15 rows .* are kept"):
        script.run(plan_draws.sample(state, 25, None, False, None))
    assert all(target == WRITER for target, _ in script.sent)
    assert state.kept.count() == 15
    waits = [op for op in script.ops if isinstance(op, Wait)]
    assert {op.timeout for op in waits} == {1.0 + 2.0}, "a consuming draw waits for the rate limit too"
    script = Script(lambda r: pytest.fail("the kept rows were enough: nothing is sent"))
    batch = script.run(plan_draws.sample(state, 15, None, False, None)).result()
    assert batch["x"].tolist() == [*range(10), *range(5)] and state.kept.count() == 0


def test_a_consuming_draw_that_cannot_send_cancels_what_waits_and_reads_what_was_served() -> None:
    state = make_state(QUEUE, max_in_flight=8)

    def answer(r: Any) -> Any:
        if isinstance(r, P.Cancel):
            return P.CancelReply(r.request_id, np.array([2], np.uint64))  # the second still waited
        return rows_reply(r)

    def plan() -> Any:
        sent = []
        for request in plan_draws.sample_requests(state, 30, None, state.table(None)):
            sent.append((yield Send(WRITER, request)))
        return (yield from collect(state, WRITER, sent, cancel=True, timeout=3.0))

    script = Script(answer)
    parts, error = script.run(plan())
    assert error is None and [len(info) for _, info in parts] == [10, 10], "the served two are read"
    cancel = [r for _, r in script.sent if isinstance(r, P.Cancel)][0]
    assert cancel.request_ids.tolist() == [1, 2, 3]
    assert script.forgotten == [2]
    waits = [op for op in script.ops if isinstance(op, Wait)][1:]
    assert {op.timeout for op in waits} == {1.0}, "once cancelled, the served ones are waited for the client's timeout"


def test_a_kept_draw_handed_back_by_a_caller_that_went_away_comes_first() -> None:
    state = make_state(QUEUE)
    drawn = Script(lambda r: rows_reply(r, 40)).run(plan_draws.sample(state, 5, None, False, None))
    drawn.keep(state)
    assert state.kept.count() == 5
    batch = Script(lambda r: rows_reply(r, 90)).run(plan_draws.sample(state, 8, None, False, None)).result()
    assert batch["x"].tolist() == [40, 41, 42, 43, 44, 90, 91, 92]


# ------------------------------------------------------------------ windows and transitions


def windows_reply(r: Any, valid: bool = True) -> P.SampleSequencesReply:
    n, steps = r.batch_size, r.length
    ids = np.arange(n, dtype=np.int64) * 100
    arrays = {"x": (ids[:, None] + np.arange(steps)).astype(np.float32)} if r.with_rows else {}
    valid_steps = np.full(n, steps, np.int64) if r.pad and valid else np.zeros(0, np.int64)
    return P.SampleSequencesReply(r.request_id, *view(), ids, ids.astype(np.uint64), np.full(n, 0.1), arrays,
                                  valid_steps)


def test_windows_are_split_by_whole_windows_per_message_and_padded_ones_carry_a_mask() -> None:
    state = make_state()
    script = Script(windows_reply)
    batch = script.run(plan_draws.sample_sequences(state, 7, 3, None, False, None, True)).result()
    assert [r.batch_size for _, r in script.sent] == [3, 3, 1] and all(r.pad for _, r in script.sent)
    assert batch["x"].shape == (7, 3) and batch["mask"].all()
    with pytest.raises(ProtocolError, match="without valid_steps"):
        Script(lambda r: windows_reply(r, valid=False)).run(
            plan_draws.sample_sequences(state, 2, 3, None, False, None, True))


def test_a_window_bigger_than_a_message_is_drawn_by_id_then_read_by_row_ids() -> None:
    state = make_state()

    def answer(r: Any) -> Any:
        if isinstance(r, P.SampleSequences):
            assert not r.with_rows
            return windows_reply(r)
        return P.GetRowsReply(r.request_id, *view(), len(r.row_ids), {"x": r.row_ids.astype(np.float32)})

    script = Script(answer)
    batch = script.run(plan_draws.sample_sequences(state, 2, 12, None, False, None, False)).result()
    assert batch["x"].tolist() == [list(range(12)), list(range(100, 112))]
    assert [len(r.row_ids) for _, r in script.sent if isinstance(r, P.GetRows)] == [10, 10, 4]


def test_transitions_need_a_server_that_keeps_finals() -> None:
    with pytest.raises(ConfigError, match="keeps no final observations"):
        Script(lambda r: None).run(plan_draws.sample_transitions(make_state(), 4, 1, 0.9, False, None, None))


@pytest.mark.parametrize("call, match", [
    (lambda s: plan_draws.sample(s, 0, None, False, None), "batch_size must be a positive int"),
    (lambda s: plan_draws.sample_sequences(s, 2, True, None, False, None, False), "length must be a positive int"),
    (lambda s: plan_draws.sample(s, 2, None, False, "nope"), "no table|tables"),
])
def test_bad_arguments_raise_config_errors_naming_them(call: Callable[[LearnerState], Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Script(lambda r: None).run(call(make_state({"tables": "a", "table.a.sampler": "Uniform"})))


# ------------------------------------------------------------------ wait_for_size


def test_wait_for_size_polls_with_growing_pauses_and_says_how_many_when_it_gives_up() -> None:
    state = make_state()
    lengths = iter([0, 3, 8])
    script = Script(lambda r: P.InfoReply(r.request_id, {"length": next(lengths)}))
    assert script.run(plan_reads.wait_for_size(lambda: plan_reads.length(state), 5, None)) == 8
    assert [op.seconds for op in script.ops if isinstance(op, Sleep)] == [0.01, 0.02]
    script = Script(lambda r: P.InfoReply(r.request_id, {"length": 2}))
    with pytest.raises(NotEnoughDataError, match="2 rows may be sampled after 1 s of waiting, fewer than the 5"):
        script.run(plan_reads.wait_for_size(lambda: plan_reads.length(state), 5, 1))
    assert script.clock == pytest.approx(101.0)
    for size, timeout in ((-1, None), (True, None), (3, -1.0), (3, "1")):
        with pytest.raises(ConfigError):
            Script(lambda r: None).run(plan_reads.wait_for_size(lambda: finished(0), size, timeout))


# ------------------------------------------------------------------ batches


def test_batches_without_a_seed_carry_several_batches_a_request_and_leaving_forgets_the_rest() -> None:
    state = make_state(limits=P.Limits(max_rows_per_message=100))
    script = Script(rows_reply)
    got = script.run(plan_batches.batches(state, 10, 8, None, False, None, None), stop_after=6)
    requests = [r for _, r in script.sent]
    assert {r.batch_size for r in requests} == {40}, "prefetch 8: up to 4 batches a request"
    assert len(requests) == 3 and len(got) == 6, "two requests in flight: the third left as the first was used up"
    assert [b["x"].shape for b in got] == [(10,)] * 6
    assert script.forgotten == [3], "the request still in flight when the loop was left"


def test_batches_of_a_consuming_table_cancel_what_waits_and_keep_what_was_drawn_when_left() -> None:
    state = make_state(QUEUE)

    def answer(r: Any) -> Any:
        if isinstance(r, P.Cancel):
            return P.CancelReply(r.request_id, r.request_ids[-1:])  # the last one still waited
        return rows_reply(r, 10 * (r.request_id - 1))

    script = Script(answer)
    got = script.run(plan_batches.batches(state, 10, 4, None, False, None, None), stop_after=2)
    assert {r.batch_size for _, r in script.sent if isinstance(r, P.Sample)} == {10}, "one batch a request"
    assert [b["x"][0] for b in got] == [0, 10]
    cancel = [r for _, r in script.sent if isinstance(r, P.Cancel)][0]
    assert cancel.request_ids.tolist() == [3, 4, 5], "prefetch 4: two taken, one sent after each"
    assert state.kept.count() == 20, "the two served in flight are kept; the cancelled one was never drawn"
    assert script.forgotten == [5]


def test_batches_of_a_consuming_table_interrupted_at_a_wait_cancel_that_request_too() -> None:
    """Regression: interrupted (a cancelled task, KeyboardInterrupt) while it waited for the oldest
    request in flight, the loop had already taken that request off its list: it was neither
    cancelled nor read, and the server drew its rows for nobody once rows came."""
    state = make_state(QUEUE)
    waits = itertools.count()

    def answer(r: Any) -> Any:
        if isinstance(r, P.Cancel):
            return P.CancelReply(r.request_id, r.request_ids)  # all still waited for rows
        return KeyboardInterrupt() if next(waits) == 1 else rows_reply(r, 10 * (r.request_id - 1))

    script = Script(answer)
    with pytest.raises(KeyboardInterrupt):
        script.run(plan_batches.batches(state, 10, 2, None, False, None, None))
    cancel = [r for _, r in script.sent if isinstance(r, P.Cancel)][0]
    assert cancel.request_ids.tolist() == [2, 3], "the request interrupted at its wait is cancelled as well"
    assert state.kept.count() == 0 and sorted(script.forgotten) == [2, 3]


def test_batches_check_their_arguments_before_the_first_batch() -> None:
    with pytest.raises(ConfigError, match="prefetch must be a positive int"):
        plan_batches.batches(make_state(), 10, 0, None, False, None, None)


# ------------------------------------------------------------------ the actor's side


def actor_state(sampling: dict[str, Any] | None = None, *, attempts: int = 3, max_in_flight: int = 2,
                batch_seconds: float = 1.0, capacity: int = 1000) -> plan_actor.ActorState:
    hello = P.HelloReply(1, SPACE.to_json(), capacity, 0, 0, "test", P.PROTOCOL_VERSION, LIMITS, "tcp://127.0.0.1:2",
                         "replay", "instance", sampling or {"sampler": "Uniform"})
    config = ClientConfig(endpoint="tcp://127.0.0.1:1", timeout=1.0, max_in_flight=max_in_flight,
                          rate_limit_timeout=2.0, commit_attempts=attempts, batch_seconds=batch_seconds)
    return plan_actor.ActorState(config, hello)


class TimedScript(Script):
    """A Script whose clock moves by a wait's timeout when its answer is "no reply"."""

    def run(self, plan: Any, *, stop_after: int | None = None) -> Any:
        answer = self.answer

        def timed(request: P.Request) -> Any:
            reply = answer(request)
            if isinstance(reply, ServerUnavailableError):
                waits = [op for op in self.ops if isinstance(op, Wait)]
                self.clock += waits[-1].timeout or 0.0
            return reply

        self.answer = timed
        try:
            return super().run(plan, stop_after=stop_after)
        finally:
            self.answer = answer


def ready(n: int = 3, key: bytes = b"k" * 16) -> plan_actor.Ready:
    return plan_actor.Ready({"x": np.arange(n, dtype=np.float32)}, n, None, key)


def commit_reply(request: Any, first: int = 0) -> P.Reply:
    return P.PushEpisodeReply(request.request_id, 7, first, request.num_rows)


def test_a_commit_whose_reply_is_lost_is_sent_again_with_the_same_key_within_its_attempts() -> None:
    state = actor_state()
    answers = iter([ServerUnavailableError("no answer"), None])
    script = TimedScript(lambda r: next(answers) or commit_reply(r, 40))
    request = plan_actor.push_request([ready()], 2.0)
    retried = script.run(plan_actor.send_commit(state, request))
    assert retried.deadline == 100.0 + state.commit_timeout == 103.0
    got = plan_actor.receipts(script.run(plan_actor.settle_commit(retried)))
    assert got == [Receipt(7, 40, 3)]
    pushes = [req for _, req in script.sent]
    assert len(pushes) == 2 and pushes[0].idempotency_key == pushes[1].idempotency_key == b"k" * 16, "a retry carries the key"
    assert [op.timeout for op in script.ops if isinstance(op, Wait)][0] == pytest.approx(1.0)


def test_a_commit_with_no_reply_to_any_attempt_is_in_doubt_after_commit_attempts_sends() -> None:
    state = actor_state(attempts=3)
    script = TimedScript(lambda r: ServerUnavailableError("no answer from the server"))
    retried = script.run(plan_actor.send_commit(state, plan_actor.push_request([ready()], 2.0)))
    with pytest.raises(ServerUnavailableError, match=r"3 attempt\(s\) within 3 s"):
        script.run(plan_actor.settle_commit(retried))
    assert len(script.sent) == 3 and script.clock <= 100.0 + state.commit_timeout + 1e-9


def test_a_commit_that_cannot_leave_is_not_sent_not_in_doubt() -> None:
    state = actor_state()
    plan = plan_actor.send_commit(state, plan_actor.push_request([ready()], 2.0))
    assert isinstance(next(plan), Now) and isinstance(plan.send(100.0), Send)
    with pytest.raises(plan_actor.NotSentError, match="no server"):
        plan.throw(ServerUnavailableError("no server connected"))


def test_the_first_attempt_waits_out_the_rate_limits_hold_so_no_second_copy_waits_there() -> None:
    state = actor_state({"sampler": "Fifo", "writer_samples": True})
    assert state.commit_hold == 2.0 and state.commit_timeout == 3 * 1.0 + 2.0
    script = TimedScript(lambda r: commit_reply(r))
    retried = script.run(plan_actor.send_commit(state, plan_actor.push_request([ready()], 2.0)))
    script.run(plan_actor.settle_commit(retried))
    assert [op.timeout for op in script.ops if isinstance(op, Wait)] == [pytest.approx(3.0)]


def test_a_refused_commit_raises_its_error_at_once_and_is_never_sent_again() -> None:
    state = actor_state()
    script = TimedScript(lambda r: refusal(r, DiskFullError("the disk is full")))
    retried = script.run(plan_actor.send_commit(state, plan_actor.push_request([ready()], 2.0)))
    with pytest.raises(DiskFullError, match="disk is full"):
        script.run(plan_actor.settle_commit(retried))
    assert len(script.sent) == 1


def test_several_episodes_leave_in_one_push_episodes_with_a_key_each_and_their_receipts_in_order() -> None:
    episodes = [ready(2, b"a" * 16), plan_actor.Ready({"x": np.ones(3, np.float32)}, 3, None, b"b" * 16,
                                                      {"x": np.zeros(1, np.float32)})]
    request = plan_actor.push_request(episodes, 2.0)(9)
    assert isinstance(request, P.PushEpisodes) and request.lengths.tolist() == [2, 3]
    assert [bytes(k) for k in request.keys] == [b"a" * 16, b"b" * 16] and request.has_final.tolist() == [0, 1]
    reply = P.PushEpisodesReply(9, np.array([[4, 10, 2], [5, 12, 3]], np.int64))
    assert plan_actor.receipts(reply) == [Receipt(4, 10, 2), Receipt(5, 12, 3)]


@pytest.mark.parametrize(("lengths", "plan"), [
    # rows_per_message 10, rows_per_push 12: the empty one sends nothing; the long one is streamed
    # after the group before it left; groups never pass 12 rows
    ([3, 0, 4, 20, 2, 2], [("empty", [1]), ("push", [0, 2]), ("streamed", [3]), ("push", [4, 5])]),
    ([5, 5, 5], [("push", [0, 1]), ("push", [2])]),
    ([10, 3], [("push", [0]), ("push", [1])]),
    ([], []),
])
def test_whole_episodes_leave_grouped_within_rows_per_push_and_long_ones_are_streamed(lengths: list[int],
                                                                                        plan: list[Any]) -> None:
    assert plan_actor.group_pushes(lengths, 10, 12) == plan


def test_rows_of_a_segment_leave_when_the_batch_is_full_or_old_enough_with_their_priorities() -> None:
    state = actor_state()
    clock = [0.0]
    rows = plan_segments.SegmentRows(state.schema, 4, 0.5, lambda: clock[0])
    assert not rows.put_exact({"x": np.float32(1)}), "no batch yet: the first rows go through add"
    out = list(rows.add({"x": np.arange(6, dtype=np.float32)}, 6, {"": np.arange(6, dtype=np.float64)}))
    assert [r.n for r in out] == [4] and out[0].arrays["x"].tolist() == [0, 1, 2, 3]
    assert out[0].priorities is not None and out[0].priorities[""].tolist() == [0, 1, 2, 3]
    assert rows.buffered == 2 and not rows.due()
    clock[0] = 0.6
    assert rows.due(), "the first buffered row is batch_seconds old"
    taken = rows.take()
    assert taken is not None and taken.n == 2 and rows.take() is None


def test_a_streamed_episode_opens_once_keeps_its_window_and_a_refused_append_aborts_it() -> None:
    state = actor_state(max_in_flight=2)
    seg = plan_segments.SegmentState(b"s" * 16)
    answers: dict[type, Any] = {P.OpenSegment: lambda r: P.OpenSegmentReply(r.request_id, 5)}
    refuse_third = itertools.count()

    def answer(r: Any) -> Any:
        if isinstance(r, P.Append):
            return refusal(r, DiskFullError("disk full")) if next(refuse_third) == 2 else P.AppendReply(r.request_id, 4)
        if isinstance(r, P.Abort):
            return P.AbortReply(r.request_id)
        return answers[type(r)](r)

    script = Script(answer)
    rows = plan_segments.Rows({"x": np.zeros(4, np.float32)}, 4, None)
    for _ in range(3):
        script.run(plan_segments.send_rows(seg, rows, state.config.max_in_flight))
    assert [type(req).__name__ for _, req in script.sent] == ["OpenSegment", "Append", "Append", "Append"]
    assert len(seg.pending) == 2, "the third append waited for the oldest first"
    with pytest.raises(DiskFullError):
        script.run(plan_segments.wait_appends(seg))
    assert seg.status == "aborted" and not seg.pending
    assert isinstance(script.sent[-1][1], P.Abort) and script.sent[-1][1].segment_id == 5
    with pytest.raises(SegmentStateError, match="aborted"):
        seg.require_open("commit")


def test_a_commit_refused_for_a_full_disk_leaves_the_segment_open_and_a_lost_one_in_doubt() -> None:
    seg = plan_segments.SegmentState()
    assert not seg.settled(None, DiskFullError("full")) and seg.status == "open"
    seg.abandon_on_failure = True
    assert seg.settled(None, DiskFullError("full")), "abandoned: the caller holds the episode"
    assert not seg.settled(None, plan_actor.NotSentError("never left")) and not seg.in_doubt
    seg.status = "committing"
    seg.settled(None, ServerUnavailableError("no answer"))
    assert seg.status == "failed" and seg.in_doubt
    with pytest.raises(SegmentStateError, match="never opened"):
        plan_segments.commit_request(plan_segments.SegmentState(), 1.0)


# ------------------------------------------------------------------ a learner on the file's host


class FileView:
    """A learner's own view of the server's file, as the plans see it (client/_local.py's
    LocalRows): draws rows 0, 1, 2, ... of `x`, until `give_up_after` draws."""

    def __init__(self, give_up_after: int = 1000) -> None:
        self.usable = True
        self.calls: list[tuple[str, int, tuple[Any, ...], dict[str, Any]]] = []
        self.confirmed: list[dict[str, Any]] = []
        self.give_up_after = give_up_after
        self._next = 0
        self._confirmed_at: float | None = None

    def due(self, now: float) -> bool:
        return self._confirmed_at is None or now - self._confirmed_at >= 1.0

    def confirm(self, stats: dict[str, Any], now: float) -> None:
        self.confirmed.append(stats)
        self._confirmed_at = now
        if stats.get("file_inode") != 7:
            self.usable = False

    def draw(self, method: str, min_seq: int, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((method, min_seq, args, kwargs))
        if len(self.calls) > self.give_up_after:
            self.usable = False
            return None
        n = args[0]
        ids = np.arange(self._next, self._next + n, dtype=np.int64)
        self._next += n
        info = SampleInfo(ids.astype(np.uint64), ids.astype(np.uint64), np.full(n, 0.5))
        return {"x": ids.astype(np.float32)}, info, View(9, 0, 0, 1000)


def info_or(answer: Callable[[P.Request], Any], inode: int = 7) -> Callable[[P.Request], Any]:
    """The server: Info answered with the file it serves (inode `inode`), the rest by `answer`."""
    def reply(request: P.Request) -> Any:
        if isinstance(request, P.Info):
            return P.InfoReply(request.request_id, {"file_device": 1, "file_inode": inode, "replay_id": "replay"})
        return answer(request)
    return reply


def test_a_learner_on_the_files_host_draws_from_its_own_view_after_the_server_confirms_the_file() -> None:
    state = make_state()
    state.local = FileView()  # type: ignore[assignment]
    script = Script(info_or(rows_reply))
    batch, info = script.run(plan_draws.sample(state, 25, None, True, None)).result()
    assert [type(r).__name__ for _, r in script.sent] == ["Info"] and script.sent[0][0] == WRITER
    assert batch["x"].tolist() == list(range(25)) and info.row_ids.tolist() == list(range(25))
    assert [c[0] for c in state.local.calls] == ["sample"] and state.local.calls[0][2][0] == 25, "one draw of 25"
    assert state.view is not None and state.view.seq == 9, "the view drawn in is this client's view"
    script.run(plan_draws.sample(state, 5, None, False, None))
    assert len(script.sent) == 1, "confirmed a moment ago: no request at all"
    script.clock += 1.5
    script.run(plan_draws.sample(state, 5, None, False, None))
    assert [type(r).__name__ for _, r in script.sent] == ["Info", "Info"], "asked again a second later"


def test_seeded_draws_from_the_view_come_in_the_parts_and_seeds_the_server_would_draw() -> None:
    state = make_state()
    state.local = FileView()  # type: ignore[assignment]
    script = Script(info_or(rows_reply))
    script.run(plan_draws.sample(state, 25, 3, False, None))
    sizes = [c[2][0] for c in state.local.calls]
    rngs = [c[2][1] for c in state.local.calls]
    assert sizes == [10, 10, 5], "as the server splits a batch over messages"
    expected = [np.random.default_rng(seed).random() for seed in (3, 4, 5)]
    assert [g.random() for g in rngs] == expected, "each part's generator made from seed + part"


def test_a_view_that_is_not_the_file_the_server_serves_is_given_up_and_the_draw_travels() -> None:
    state = make_state()
    state.local = FileView()  # type: ignore[assignment]
    script = Script(info_or(rows_reply, inode=8))
    batch = script.run(plan_draws.sample(state, 5, None, False, None)).result()
    assert [type(r).__name__ for _, r in script.sent] == ["Info", "Sample"] and not state.local.calls
    assert batch["x"].tolist() == list(range(5))


def test_draws_of_a_consuming_table_go_to_the_server_even_on_the_files_host() -> None:
    state = make_state(QUEUE)
    state.local = FileView()  # type: ignore[assignment]
    script = Script(info_or(rows_reply))
    script.run(plan_draws.sample(state, 5, None, False, None))
    assert [(target, type(r).__name__) for target, r in script.sent] == [(WRITER, "Sample")]
    assert not state.local.calls


def test_batches_come_from_the_view_one_at_a_time_then_pipelined_once_it_is_given_up() -> None:
    state = make_state(limits=P.Limits(max_rows_per_message=100))
    state.local = FileView(give_up_after=3)  # type: ignore[assignment]
    script = Script(info_or(lambda r: rows_reply(r, 500)))
    got = script.run(plan_batches.batches(state, 10, 8, None, False, None, None), stop_after=6)
    # The fourth draw finds the view given up and goes to the server; the pipelined ones follow.
    assert [int(b["x"][0]) for b in got] == [0, 10, 20, 500, 500, 510]
    kinds = [type(r).__name__ for _, r in script.sent]
    assert kinds[0] == "Info" and kinds.count("Sample") >= 2, "after the view gave up: requests kept in flight"
    assert len(state.local.calls) == 4, "three batches drawn from the view, the fourth draw found it given up"

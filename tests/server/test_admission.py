"""JobSlots (the server's admission: slots and the FIFO queue) and in_fresh_thread, in this process without a server."""

import asyncio
import threading

import pytest

from mizuoto.runtime.lease import Lease
from mizuoto.server.admission import JobSlots
from mizuoto.server.jobs import in_fresh_thread


def test_slots_then_queue_then_refusal_and_slots_pass_to_the_oldest_waiter():
    a = JobSlots(limit=1, max_queued=2, timeout=None)
    first, second, third = a.enter(), a.enter(), a.enter()
    assert first.granted.is_set() and not second.granted.is_set() and not third.granted.is_set()
    assert a.enter() is None and a.full() and a.queued == 2
    assert not a.try_acquire()  # nobody overtakes the line
    a.release()
    assert second.granted.is_set() and not third.granted.is_set() and a.active == 1 and a.queued == 1
    assert a.wait(second, Lease())
    a.release()
    a.release()
    assert a.active == 0 and a.queued == 0 and a.try_acquire()


def test_a_wait_ends_on_cancel_deadline_or_queue_timeout_and_leaves_the_line():
    a = JobSlots(limit=1, max_queued=2, timeout=0.2)
    a.enter()
    cancelled = Lease()
    cancelled.cancel()
    ticket = a.enter()
    assert not a.wait(ticket, cancelled) and a.queued == 0
    late = a.enter()
    assert not a.wait(late, Lease()) and a.queued == 0  # the 0.2 s queue timeout
    past = a.enter()
    assert not a.wait(past, Lease(0.0)) and a.queued == 0  # the request's own deadline
    a.release()
    assert a.active == 0


def test_in_fresh_thread_returns_raises_and_ends_its_thread():
    names = []

    def work(x):
        names.append(threading.current_thread().name)
        return x * 2

    def fail():
        raise ValueError("boom")

    async def run():
        assert await in_fresh_thread(work, 21) == 42
        with pytest.raises(ValueError, match="boom"):
            await in_fresh_thread(fail)

    asyncio.run(run())
    assert names == ["mizuoto-compute"]
    for t in threading.enumerate():
        if t.name == "mizuoto-compute":
            t.join(5)
    assert not any(t.name == "mizuoto-compute" for t in threading.enumerate())


def test_a_jobs_slot_stays_taken_until_its_cancelled_requests_compute_has_ended():
    """The slot goes with the request's lease: a cancelled job whose call still runs on a compute loop keeps it,
    so a queued job does not start beside a computation the runtime still counts as the first one's."""
    from mizuoto.server.jobs import Cancelled, Job

    slots = JobSlots(limit=1, max_queued=1, timeout=None)
    computing, cancelled = threading.Event(), threading.Event()
    work: list[Lease] = []

    def start(lease: Lease):
        lease.begin_work()  # a call of the request's queued on its model's compute loop
        work.append(lease)
        computing.set()
        yield from ()
        assert cancelled.wait(10)  # the engine's next stage call would see the cancel
        lease.check("in the test")

    async def run():
        job = Job(start, slots, slots.enter(), Lease(), lambda job: None, lambda waited: None).run()
        assert await asyncio.to_thread(computing.wait, 10)
        job.cancel()
        cancelled.set()
        with pytest.raises(Cancelled):
            await job.next()
        assert await asyncio.to_thread(job.join, 10)
        assert slots.active == 1, "the slot was given back while the request's call still ran"
        waiting = slots.enter()
        assert not waiting.granted.is_set() and slots.queued == 1
        work[0].end_work()  # the call ends on its loop: the lease is released there, and the slot with it
        assert waiting.granted.is_set() and slots.active == 1
        slots.release()

    asyncio.run(run())

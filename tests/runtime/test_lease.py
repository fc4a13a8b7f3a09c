"""The request context (runtime.lease): cancel with a reason, deadline, bounded waits, one release."""

import threading
import time

import pytest

from mizuoto.errors import DeadlineExceeded, RequestCancelled
from mizuoto.runtime.lease import POLL_S, Lease


def test_a_cancel_keeps_its_first_reason_and_ends_a_wait_from_another_thread():
    lease, never = Lease(), threading.Event()
    outcome = []

    def wait():
        try:
            lease.wait(never, "while waiting for the test")
        except RequestCancelled as e:
            outcome.append((str(e), time.monotonic()))
    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.1)
    cancelled_at = time.monotonic()
    lease.cancel("by the test")
    lease.cancel("by someone later")
    t.join(5)
    assert outcome and outcome[0][0] == "the request was cancelled by the test while waiting for the test"
    assert outcome[0][1] - cancelled_at < POLL_S + 0.5
    assert lease.cancelled and not lease.expired


def test_a_deadline_ends_waits_with_its_own_error():
    lease, cond = Lease(0.2), threading.Condition()
    start = time.monotonic()
    with cond, pytest.raises(DeadlineExceeded, match="past its deadline while waiting for nothing"):
        lease.wait_for(cond, lambda: False, "while waiting for nothing")
    assert 0.15 < time.monotonic() - start < 1.0
    assert lease.cancelled and lease.expired and lease.remaining() == 0.0
    assert Lease().remaining() is None and not Lease(60).cancelled


def test_a_wait_that_is_answered_returns_and_release_runs_each_callback_once_newest_first():
    lease, ready = Lease(5), threading.Event()
    threading.Timer(0.05, ready.set).start()
    lease.wait(ready, "while waiting")  # no error: answered before the deadline
    done = []
    lease.on_release(lambda: done.append("first"))
    lease.on_release(lambda: done.append("second"))
    lease.release()
    lease.release()
    assert done == ["second", "first"]
    lease.on_release(lambda: done.append("late"))  # already released: runs at once
    assert done == ["second", "first", "late"] and lease.released


def test_the_current_lease_is_the_one_the_runtime_runs_code_as_and_a_model_uses_it(tone_dir):
    """Model.use/submit take the lease of the request whose code runs (lease.current), so engines pass none."""
    from mizuoto.runtime.executor import Executor
    from mizuoto.runtime.lease import current, within
    from mizuoto.runtime.options import LoadOptions
    from mizuoto.testing.toy import ToneEngine

    lease, other = Lease(), Lease()
    assert current() is None
    with within(lease):
        assert current() is lease
        with within(None):
            assert current() is lease  # None leaves it as it is
        with within(other):
            assert current() is other
        assert current() is lease
    assert current() is None
    model = ToneEngine().load(tone_dir, LoadOptions(device="cpu"))
    model.executor = ex = Executor("t")
    try:
        assert ex.call(current, lease) is lease  # a compute call runs as its request
        with within(lease):
            assert model.submit(current) is lease
        lease.cancel("by the test")
        with within(lease), pytest.raises(RequestCancelled, match="by the test"):
            model.submit(lambda: None)  # a submit without a lease takes the current one
        with within(lease), pytest.raises(RequestCancelled, match="before its notes stage call"):
            with model.use("notes"):
                pass
    finally:
        ex.close()

"""runtime.threads: work run in a thread that ends leaves no OpenMP team behind."""

from __future__ import annotations

import threading

import pytest
import torch

from mizuoto.runtime.threads import in_thread, spawn
from mizuoto.testing.omp_teams import supported, threads_left_by

BIG = torch.ones(1 << 20)  # made here: filling it is a parallel region too


@pytest.fixture
def two_threads():
    """At least two intra-op threads, so a team has a worker to count on any machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))
    yield torch.get_num_threads()
    torch.set_num_threads(before)


@pytest.mark.skipif(not supported(), reason="counts threads by name: Linux only")
def test_a_parallel_reduction_leaves_a_team_and_in_thread_does_not(two_threads):
    # the probe itself: a reduction over a large tensor starts a team in the calling thread
    assert threads_left_by(lambda: BIG.sum()) == two_threads - 1 > 0
    assert threads_left_by(lambda: in_thread(lambda: BIG.sum())) == 0


def test_in_thread_returns_or_raises_what_fn_did():
    assert in_thread(lambda: 41 + 1) == 42
    with pytest.raises(ZeroDivisionError):
        in_thread(lambda: 1 / 0)


def test_spawn_settles_from_the_new_thread_and_the_thread_ends():
    settled: list[tuple[bool, object, str]] = []

    def settle(ok: bool, value: object) -> None:
        settled.append((ok, value, threading.current_thread().name))

    spawn(lambda: 42, settle, "mzt-spawn").join(5)
    thread = spawn(lambda: 1 / 0, settle, "mzt-spawn")
    thread.join(5)
    assert not thread.is_alive()
    assert settled[0] == (True, 42, "mzt-spawn")
    ok, error, name = settled[1]
    assert not ok and isinstance(error, ZeroDivisionError) and name == "mzt-spawn"


def test_a_cancel_ends_the_wait_for_in_thread_and_the_thread_stays_the_requests_work_until_joined():
    """in_thread with a lease: the caller leaves within a second of the cancel; the thread runs on as the
    request's work (its release waits for it) and join_spawned joins it."""
    from mizuoto.errors import RequestCancelled
    from mizuoto.runtime.lease import Lease
    from mizuoto.runtime.threads import join_spawned
    from mizuoto.testing.waits import cancel_during

    started, go = threading.Event(), threading.Event()

    def work():
        started.set()
        assert go.wait(20)
        return 1
    lease = Lease()
    try:
        error, took = cancel_during(lambda: in_thread(work, lease=lease), lease, started.is_set, settle=0.0)
        assert isinstance(error, RequestCancelled) and took < 1.0
        lease.release()
        assert not lease.released and any(t.name == "mizuoto-compute" for t in threading.enumerate())
    finally:
        go.set()
    assert join_spawned(10) == [] and lease.released

"""runtime.threads: work run in a thread that ends leaves no OpenMP team behind."""

from __future__ import annotations

import pytest
import torch

from mizuoto.runtime.threads import in_thread
from mizuoto.testing.omp_teams import supported, threads_left_by

BIG = torch.ones(1 << 20)  # made here: filling it is a parallel region too


@pytest.mark.skipif(not supported(), reason="counts threads by name: Linux only")
def test_a_parallel_reduction_leaves_a_team_and_in_thread_does_not():
    # the probe itself: a reduction over a large tensor starts a team in the calling thread
    assert threads_left_by(lambda: BIG.sum()) == torch.get_num_threads() - 1
    assert threads_left_by(lambda: in_thread(lambda: BIG.sum())) == 0


def test_in_thread_returns_or_raises_what_fn_did():
    assert in_thread(lambda: 41 + 1) == 42
    with pytest.raises(ZeroDivisionError):
        in_thread(lambda: 1 / 0)

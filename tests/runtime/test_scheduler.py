"""Scheduler: stage modules move as the plan says, for plain and streaming (generator) stages."""

import pytest
import torch

from mizuoto.runtime.engine import Reference, SynthesisRequest
from mizuoto.errors import InvalidRequest
from mizuoto.runtime.memory import Plan, measure, run_groups
from mizuoto.runtime.options import LoadOptions
from mizuoto.runtime.scheduler import Scheduler
from mizuoto.testing.toy import ToneEngine

PRESET = SynthesisRequest("abcdefghij", mode="preset", voice="low", seed=0)


def _setup(tone_dir, stream, pinned):
    """A scheduler over a fresh tone model and a plan pinning `pinned` (sizes do not matter here)."""
    model = ToneEngine().load(tone_dir, LoadOptions(device="cpu"))
    sizes = measure(model.stages, None, "cpu")
    plan = Plan("m", "cpu", 2**40, stream, sizes, pinned, run_groups(sizes, stream), 0)
    return model, Scheduler(model, "cpu"), plan


def _run(sched, request):
    with sched.hold():
        return list(sched.execute(request))


def test_turns_move_each_stage_in_and_out(tone_dir):
    model, sched, plan = _setup(tone_dir, stream=False, pinned=())
    assert plan.strategy == "turns"
    sched.apply(plan)
    assert sched.trace == []
    ref = (torch.sin(torch.arange(4000) * 0.1), 16000)
    _run(sched, SynthesisRequest("abc", mode="cross_lingual", voice=Reference(ref), seed=0))
    assert sched.trace == [("listen", "device"), ("listen", "host"), ("notes", "device"),
                           ("notes", "host"), ("render", "device")]
    sched.trace.clear()
    _run(sched, PRESET)  # render is still in from the last request
    assert sched.trace == [("render", "host"), ("notes", "device"), ("notes", "host"), ("render", "device")]


def test_streaming_keeps_its_group_together(tone_dir):
    model, sched, plan = _setup(tone_dir, stream=True, pinned=("listen",))
    assert plan.groups == (("listen",), ("notes", "render"))
    sched.apply(plan)
    assert sched.trace == [("listen", "device")]
    chunks = _run(sched, SynthesisRequest("abcdefghij", mode="preset", voice="low", seed=0, stream=True))
    assert len(chunks) == 3
    # notes and render come in together once, then stay while the generator alternates between them
    assert sched.trace == [("listen", "device"), ("notes", "device"), ("render", "device")]
    sched.apply(Plan("m", "cpu", 2**40, False, plan.stages, ("render",), run_groups(plan.stages, False), 0))
    assert sched.trace[3:] == [("listen", "host"), ("notes", "host")]


def test_resident_plan_moves_once_and_offload_returns_all(tone_dir):
    model, sched, plan = _setup(tone_dir, stream=False, pinned=("listen", "notes", "render"))
    assert plan.strategy == "resident"
    sched.apply(plan)
    assert sched.trace == [("listen", "device"), ("notes", "device"), ("render", "device")]
    _run(sched, PRESET)
    _run(sched, PRESET)
    assert len(sched.trace) == 3
    sched.offload()
    assert sched.trace[3:] == [("listen", "host"), ("notes", "host"), ("render", "host")] and sched.plan is None
    with pytest.raises(InvalidRequest, match="no plan"):
        _run(sched, PRESET)


def test_results_do_not_depend_on_the_plan(tone_dir):
    outs = []
    for pinned in ((), ("notes",), ("listen", "notes", "render")):
        model, sched, plan = _setup(tone_dir, stream=False, pinned=pinned)
        sched.apply(plan)
        outs.append(_run(sched, PRESET)[0].samples)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_unbound_model_runs_where_it_is(tone_dir):
    model = ToneEngine().load(tone_dir, LoadOptions(device="cpu"))
    chunks = list(model.synthesize(PRESET))
    assert len(chunks) == 1 and chunks[0].final
    with model.use("notes") as device:
        assert device == torch.device("cpu")
    with pytest.raises(InvalidRequest, match="no stage 'lm'"):
        model.stage("lm")

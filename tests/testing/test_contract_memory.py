"""The contract suite's memory check fails on a stage call that needs more than its engine plans for it."""

from __future__ import annotations

import pytest
import torch

from mizuoto.runtime.plugins import default_registry
from mizuoto.testing.contract import Case, test_each_stage_call_stays_within_its_planned_memory as memory_check
from mizuoto.testing.toy import ToneEngine, write_model


class _Greedy(ToneEngine):
    """The tone engine, its render calls touching 64 MiB more than the figure it declares for them."""

    name = "greedy-tone"

    def load(self, model_dir, options):
        model = super().load(model_dir, options)
        waves = model._waves

        def greedy(*args):
            scratch = torch.ones(16 << 20)  # 64 MiB, written: resident while the call runs
            out = waves(*args)
            return out if scratch.sum() > 0 else out
        model._waves = greedy
        return model


def test_the_memory_check_fails_on_a_call_beyond_its_plan(tmp_path, monkeypatch):
    registry = default_registry()
    monkeypatch.setattr(registry, "engine_class", lambda name: _Greedy if name == _Greedy.name else
                        type(registry).engine_class(registry, name))
    with pytest.raises(AssertionError, match="render .*beyond|beyond their planned memory"):
        memory_check(Case(_Greedy.name, write_model(tmp_path / "tone")))


def test_the_memory_check_passes_the_same_engine_as_declared(tmp_path, monkeypatch):
    registry = default_registry()
    monkeypatch.setattr(registry, "engine_class", lambda name: ToneEngine if name == _Greedy.name else
                        type(registry).engine_class(registry, name))
    memory_check(Case(_Greedy.name, write_model(tmp_path / "tone")))

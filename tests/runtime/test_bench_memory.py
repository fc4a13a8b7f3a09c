"""`mizuoto bench --memory`: every reserved stage call measured against its planned figure, a fresh process per case.

The driver here runs the tone engine (mizuoto.testing.toy), whose render calls reserve 4 bytes per
sample of their notes and really allocate them (float64 waves, then float32).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from mizuoto.cli.main import main as cli_main
from mizuoto.errors import InvalidRequest, MizuotoError, RequestCancelled
from mizuoto.nn.memory import HEAP_PACKING_BYTES
from mizuoto.runtime.bench_memory import (CallRecorder, MemoryCase, call_line, format_memory, memory_cases, run_case,
                                          run_case_process, summarize)
from mizuoto.runtime.engine import SynthesisRequest
from mizuoto.runtime.lease import Lease
from mizuoto.runtime.memprobe import measure_peak
from mizuoto.testing.toy import NOTE_SECONDS, ToneEngine, write_model
from mizuoto.testing.waits import cancel_during, held_elsewhere


class ToneMemoryDriver:
    """The tone model's requests: one note per character, render calls reserved through Model.room."""

    name = "tone (memory)"
    tokens_per_second = 1 / NOTE_SECONDS

    def __init__(self, model_dir, random, options, settings, workdir):
        self.device = torch.device(options.device)
        self.model = ToneEngine().load(Path(model_dir), options)

    def memory_case(self, tokens: int, stream: bool, rows: int) -> None:
        for _ in range(rows):
            list(self.model.synthesize(SynthesisRequest("a" * tokens, voice="low", seed=0, stream=stream)))


def _driver(tmp_path):
    from mizuoto.runtime.options import LoadOptions

    return ToneMemoryDriver(write_model(tmp_path / "tone", sample_rate=48000), None,
                            LoadOptions(device="cpu"), None, tmp_path)


def test_the_probe_sees_what_a_block_allocates():
    with measure_peak("cpu") as peak:
        x = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched
        del x
    assert 0.95 * (64 << 20) <= peak[0] < (80 << 20)  # give or take what the process freed meanwhile
    with measure_peak("cpu") as peak:
        pass
    assert peak[0] < (4 << 20)


def test_each_reserved_call_is_recorded_with_its_sizes_plan_and_peak(tmp_path):
    driver = _driver(tmp_path)
    calls = run_case(driver, MemoryCase(60, stream=False))
    assert [c["stage"] for c in calls] == ["render"]  # one render call: a whole request
    (call,) = calls
    samples = int(NOTE_SECONDS * 48000)
    assert call["sizes"] == {"notes": 1000, "samples": samples} and call["planned"] == 4 * 1000 * samples
    assert call["planned"] <= call["measured"]  # its float64 waves: twice what it declares
    assert (call["seconds"], call["stream"], call["rows"]) == (60, False, 1)
    streamed = run_case(driver, MemoryCase(1, stream=True))
    assert len(streamed) > 1 and {c["sizes"]["notes"] for c in streamed} <= {1, 2, 3, 4}
    assert driver.model.executor is None  # the case's executor closed, the model as it was


def test_a_driver_without_the_memory_api_is_refused(tmp_path):
    class Old:
        name = "old"
        device = torch.device("cpu")
    with pytest.raises(InvalidRequest, match="has no 'model'"):
        run_case(Old(), MemoryCase(1))


def test_the_summary_names_the_calls_outside_the_band():
    mib, extra = 1 << 20, HEAP_PACKING_BYTES  # every figure carries the heap's allowance; the band is without it
    calls = [{"stage": "flow", "seconds": 5, "stream": False, "rows": 1, "planned": 130 * mib + extra,
              "measured": 100 * mib},
             {"stage": "flow", "seconds": 5, "stream": False, "rows": 1, "planned": 90 * mib + extra,
              "measured": 100 * mib},
             {"stage": "hift", "seconds": 5, "stream": True, "rows": 1, "planned": 110 * mib + extra,
              "measured": 100 * mib},
             {"stage": "llm", "seconds": 1, "stream": False, "rows": 8, "planned": 100 * mib - 1 + extra,
              "measured": 100 * mib + extra}]
    rows = summarize(calls)
    assert [(r["case"], r["stage"], r["calls"], r["within"]) for r in rows] == [
        ("5 s whole", "flow", 2, True), ("5 s streamed", "hift", 1, True), ("1 s whole x8", "llm", 1, False)]
    assert rows[0]["ratio_min"] == 0.9 and rows[0]["ratio_max"] == 1.3
    assert not summarize(calls[:1], ratio=1.2)[0]["within"]
    text = format_memory(rows, "title")
    assert text.splitlines()[0] == "title" and "0.90-1.30\n" in text and "(measured above the figure" in text


def test_a_case_runs_in_a_fresh_process_and_a_failing_one_says_why(tmp_path, capfd):
    model_dir = write_model(tmp_path / "tone")
    spec = {"model_dir": str(model_dir), "workdir": str(tmp_path), "options": {"device": "cpu"},
            "driver": f"{__file__}:ToneMemoryDriver", "case": {"seconds": 2, "stream": True, "rows": 1}}
    calls = run_case_process(spec, timeout=120)
    assert calls and all(c["stage"] == "render" and c["stream"] for c in calls)
    # each measured call was reported as it ended (a long case's progress), in the order recorded
    progress = [line for line in capfd.readouterr().err.splitlines() if line.startswith("bench --memory:")]
    assert progress == [call_line(c) for c in calls]
    with pytest.raises(MizuotoError, match="failed: .*seconds > 0"):
        run_case_process({**spec, "case": {"seconds": -1, "stream": False, "rows": 1}}, timeout=120)


def test_the_command_prints_the_table_and_json(tmp_path, capsys):
    model_dir = write_model(tmp_path / "tone")
    argv = ["bench", str(model_dir), "--driver", f"{__file__}:ToneMemoryDriver", "--memory", "1,2",
            "--memory-rows", "1", "--memory-modes", "whole", "--device", "cpu"]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert "planned vs measured working memory per stage call" in out
    assert "1 s whole" in out and "2 s whole" in out and "streamed" not in out
    assert cli_main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert {c["seconds"] for c in result["calls"]} == {1, 2} and result["summary"]
    assert cli_main([*argv, "--memory-served"]) == 1  # one row: no batch to serve
    assert "--memory-served runs whole requests in a batch" in capsys.readouterr().err


def test_the_cases_are_the_lengths_modes_and_rows_asked_for():
    whole, streamed = False, True
    assert memory_cases([1, 5], [whole], [8]) == [MemoryCase(1, False, 8), MemoryCase(5, False, 8)]
    assert memory_cases([1], [whole, streamed], [8, 1, 8]) == [
        MemoryCase(1, False), MemoryCase(1, True), MemoryCase(1, False, 8)]
    assert memory_cases([2], [streamed], [8]) == [MemoryCase(2, True)]  # a streamed request is one row
    assert memory_cases([1, 5], [whole, streamed], [1, 8], served=True) == [
        MemoryCase(1, False), MemoryCase(1, True), MemoryCase(5, False), MemoryCase(5, True),
        MemoryCase(1, False, 8, served=True), MemoryCase(5, False, 8, served=True)]  # instead of the plain batches
    assert MemoryCase(60, False, 8, True).label == "60 s whole x8 served"
    for stream, rows in ((True, 8), (False, 1)):  # streamed, or no batch to serve
        with pytest.raises(InvalidRequest, match="served case"):
            MemoryCase(1, stream, rows, served=True)


def test_a_served_case_measures_each_call_beside_the_rows_reservations():
    """The rows' sequence-stage reservations span the other requests' calls: in a served case they are not
    measured, and a call of another stage made while they are open is; otherwise the outer one is measured."""
    model = type("M", (), {"stages": ()})()
    for unmeasured, recorded in ((frozenset({"lm"}), ["voc"]), (frozenset(), ["lm"])):
        recorder = CallRecorder(model, torch.device("cpu"), unmeasured)
        with recorder.reserve("lm", None, 1, {"positions": 9}):
            with recorder.reserve("voc", None, 2, {"frames": 3}):
                pass
        assert [c["stage"] for c in recorder.calls] == recorded


def test_two_requests_calls_in_a_served_case_take_turns_and_both_are_measured():
    model = type("M", (), {"stages": ()})()
    recorder = CallRecorder(model, torch.device("cpu"), frozenset({"lm"}))
    second_in = threading.Event()

    def second() -> None:
        with recorder.reserve("voc", None, 2, {"frames": 2}):
            second_in.set()
    thread = threading.Thread(target=second)
    with held_elsewhere(lambda: recorder.reserve("voc", None, 2, {"frames": 1})):
        thread.start()
        assert not second_in.wait(0.2)  # the second call waits for the first's reservation to end
    thread.join(10)
    assert second_in.is_set() and [c["sizes"]["frames"] for c in recorder.calls] == [1, 2]


def test_a_served_call_waiting_for_its_turn_ends_on_its_cancel_or_past_the_turn_timeout():
    model = type("M", (), {"stages": ()})()
    recorder = CallRecorder(model, torch.device("cpu"), frozenset({"lm"}))
    recorder.turn_timeout = 0.2

    def measured(lease: Lease | None, frames: int) -> None:
        with recorder.reserve("flow", lease, 2, {"frames": frames}):
            pass
    with held_elsewhere(lambda: recorder.reserve("voc", None, 2, {"frames": 1})):
        lease = Lease()
        error, took = cancel_during(lambda: measured(lease, 2), lease)  # cancelled while it waits
        assert isinstance(error, RequestCancelled) and "waited for its turn" in str(error) and took < 1
        with pytest.raises(MizuotoError, match="waited more than 0.2 s"):
            measured(None, 3)
    measured(None, 4)  # the turn is free again
    assert [c["sizes"]["frames"] for c in recorder.calls] == [1, 4]


def test_a_served_case_needs_a_driver_that_runs_one(tmp_path):
    with pytest.raises(InvalidRequest, match="runs no served case"):
        run_case(_driver(tmp_path), MemoryCase(1, False, 2, served=True))

"""`mizuoto bench`: the harness's arithmetic, output and driver lookup, with a stand-in driver."""

from __future__ import annotations

import argparse
import json
import threading
from pathlib import Path

import pytest
import torch

from mizuoto.cli import bench as cli_bench
from mizuoto.runtime import bench
from mizuoto.errors import InvalidRequest


FAKE_LOOP = {"step 1": 0.25, "step 3": 0.5, "prefill": 0.125, "flow": 1.0, "vocoder": 0.5, "chunk": 0.125,
             "idle": 0.25}
LOOP_LOCK = threading.Lock()


class FakeDriver:
    """Stages that do a little real work and report fixed sizes."""

    name = "fake (random weights)"
    sample_rate = 1000

    def __init__(self, model_dir, random, options, settings, workdir):
        self.device = torch.device(options.device)
        self.args = (model_dir, random, settings, workdir)
        self.calls: list[str] = []
        self.loop: dict[str, float] = {}
        self._thread()  # where it was built, then where each call ran
        if workdir is not None:  # --driver loads this file as its own module: report through a file
            (Path(workdir) / "args.json").write_text(json.dumps([random, str(workdir)]))

    def _thread(self):
        if self.args[3] is not None:
            with open(Path(self.args[3]) / "threads.txt", "a") as f:
                f.write(threading.current_thread().name + "\n")

    def _call(self, stage):
        self.calls.append(stage)
        self._thread()
        if self.args[3] is not None:
            with open(Path(self.args[3]) / "calls.txt", "a") as f:
                f.write(stage + "\n")

    def lm(self, tokens):
        self._call("lm")
        return list(range(tokens))

    def lm_bytes_per_step(self, tokens):
        return 2_000_000

    def flow(self, tokens):
        self._call("flow")
        return torch.zeros(1, 4, 2 * len(tokens))

    def vocoder(self, mel):
        self._call("vocoder")
        return torch.zeros(1, mel.shape[-1] * 10)  # 20 samples per token at 1 kHz

    def stream(self, tokens):
        self._call("stream")
        with LOOP_LOCK:
            for kind, t in FAKE_LOOP.items():  # a batch loop's time by kind, per streamed request
                self.loop[kind] = self.loop.get(kind, 0.0) + t
        for _ in range(3):
            yield torch.zeros(10)

    def loop_seconds(self):
        with LOOP_LOCK:
            return dict(self.loop)


def fake_factory(*args):
    return FakeDriver(*args)


def test_summary_arithmetic():
    driver = FakeDriver(None, None, argparse.Namespace(device="cpu"), None, None)
    settings = bench.BenchSettings(tokens=100, runs=3)
    runs = [{"lm_s": lm, "flow_s": 0.2, "vocoder_s": 0.1, "audio_s": 2.0, "first_chunk_s": 0.05,
             "peak_bytes": 1e9} for lm in (1.0, 3.0, 2.0)]
    r = bench.summarize(runs, driver, settings)
    assert r["lm_ms_per_token"] == pytest.approx(20.0)  # median 2.0 s over 100 tokens
    assert r["flow_ms_per_audio_second"] == pytest.approx(100.0)
    assert r["vocoder_ms_per_audio_second"] == pytest.approx(50.0)
    assert r["rtf"] == pytest.approx(2.3 / 2.0)
    assert r["first_chunk_ms"] == pytest.approx(50.0)
    assert r["lm_achieved_gb_per_s"] == pytest.approx(2e6 / 0.02 / 1e9)
    assert "device_bandwidth_gb_per_s" not in r  # CPU: no device bandwidth
    text = bench.format_table(r)
    for needle in ("20.00 ms/token", "100.0 ms per second of audio", "RTF", "first chunk", "GB/s"):
        assert needle in text
    # with the first token timed alone, a step is the rest over the other tokens; the bandwidth is the step's
    for run, first in zip(runs, (0.1, 0.4, 0.2)):
        run["lm_first_s"] = first
    r = bench.summarize(runs, driver, settings)
    assert r["lm_first_token_ms"] == pytest.approx(200.0) and r["lm_ms_per_token"] == pytest.approx(20.0)
    assert r["lm_ms_per_step"] == pytest.approx(1e3 * (2.0 - 0.2) / 99)
    assert r["lm_achieved_gb_per_s"] == pytest.approx(2e6 / ((2.0 - 0.2) / 99) / 1e9)
    assert "200 ms to the first token" in bench.format_table(r)
    # the read beside the step is the better of one before the runs and one after them
    assert bench.summarize(runs, driver, settings, read_before=1e6)["device_read_gb_per_s"] == 1e6
    assert bench.summarize(runs, driver, settings, read_before=1e-9)["device_read_gb_per_s"] > 1e-9


def _parse(argv):
    parser = argparse.ArgumentParser()
    run = cli_bench.configure(parser)
    return run, parser.parse_args(argv)


def test_command_runs_a_driver_and_prints_json(capsys, tmp_path):
    run, args = _parse(["--random", "fake", "--driver", f"{Path(__file__)}:fake_factory", "--tokens", "7",
                        "--runs", "3", "--warmup", "2", "--stream", "--device", "cpu", "--json",
                        "--workdir", str(tmp_path)])
    assert run(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == 7 and out["runs"] == 3 and out["model"] == "fake (random weights)"
    assert out["audio_seconds"] == pytest.approx(7 * 20 / 1000)
    assert out["options"]["device"] == "cpu" and out["settings"]["stream"] is True
    assert "first_chunk_ms" in out and out["peak_memory_bytes"] > 0
    calls = (tmp_path / "calls.txt").read_text().split()
    # each run: the request, its first token alone (the prefill, to time the steps apart), the stream
    assert calls == ["lm", "flow", "vocoder", "lm", "stream"] * 5  # 2 warm-up + 3 measured
    assert json.loads((tmp_path / "args.json").read_text()) == ["fake", str(tmp_path)]


def test_command_prints_a_table(capsys):
    run, args = _parse(["--random", "fake", "--driver", f"{Path(__file__)}:fake_factory", "--tokens", "3",
                        "--runs", "1", "--warmup", "0", "--device", "cpu"])  # a temporary workdir
    assert run(args) == 0
    text = capsys.readouterr().out
    assert "ms/token" in text and "fake (random weights)" in text and "first chunk" not in text


@pytest.mark.parametrize("argv, message", [
    (["--tokens", "3"], "model directory or --random"),
    (["somewhere", "--random", "x"], "model directory or --random"),
    (["--random", "nope-model"], "no engine builds a random 'nope-model'"),
    (["--random", "x", "--driver", "no-colon"], "FILE.py:NAME"),
    (["--random", "x", "--driver", "/no/such/file.py:f"], "no such file"),
    (["--random", "x", "--driver", "mizuoto.runtime.bench:nothing_here"], "has no 'nothing_here'"),
    (["--random", "x", "--tokens", "0", "--driver", "mizuoto.runtime.bench:x"], "--tokens"),
])
def test_bad_invocations_are_clear_errors(argv, message):
    run, args = _parse(argv)
    with pytest.raises(InvalidRequest, match=message):
        run(args)


def test_main_reports_errors_in_one_line(capsys):
    assert cli_bench.main(["--random", "nope-model"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: bench: no engine builds")


def test_add_bench_command_registers_a_subcommand():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    cli_bench.add_bench_command(sub)
    args = parser.parse_args(["bench", "--random", "cosyvoice2", "--json"])
    assert args.run is cli_bench.run_bench and args.random == "cosyvoice2" and args.json


def test_device_bandwidth_off_cuda():
    assert bench.device_bandwidth_gbs(torch.device("cpu"))[0] is None
    assert bench.copy_bandwidth_gbs(torch.device("cpu")) is None
    assert bench.peak_memory_bytes(torch.device("cpu"))[0] > 0


def test_cpu_defaults_are_one_short_run(capsys):
    run, args = _parse(["--random", "fake", "--driver", f"{Path(__file__)}:fake_factory", "--device", "cpu",
                        "--json"])
    assert run(args) == 0
    settings = json.loads(capsys.readouterr().out)["settings"]
    assert (settings["tokens"], settings["runs"], settings["warmup"]) == (
        bench.CPU_DEFAULTS["tokens"], bench.CPU_DEFAULTS["runs"], bench.CPU_DEFAULTS["warmup"])


def _fake(argv, workdir=None):
    extra = ["--workdir", str(workdir)] if workdir else []
    return _parse(["--random", "fake", "--driver", f"{Path(__file__)}:fake_factory", "--tokens", "5",
                   "--runs", "1", "--warmup", "0", "--device", "cpu", *extra, *argv])


def _threads(workdir) -> set:
    return set((Path(workdir) / "threads.txt").read_text().split())


def _calls(workdir) -> list:
    return (Path(workdir) / "calls.txt").read_text().split()


def test_threaded_compute_builds_and_measures_off_the_main_thread(capsys, tmp_path):
    run, args = _fake(["--threaded", "--json"], tmp_path)
    assert run(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["thread"].startswith("one worker thread") and "threaded" not in out
    assert _threads(tmp_path) == {"mizuoto-bench"}  # the driver was built there too


def test_threaded_beside_reports_both(capsys, tmp_path):
    run, args = _fake(["--threaded", "beside"], tmp_path)
    assert run(args) == 0
    text = capsys.readouterr().out
    assert "in a worker thread vs" in text and "main thread" in text
    assert _threads(tmp_path) == {"MainThread", "mizuoto-bench"}
    assert _calls(tmp_path) == ["lm", "flow", "vocoder", "lm"] * 2


def test_concurrency_sweep_json(capsys, tmp_path):
    run, args = _fake(["--concurrency", "1,3", "--json"], tmp_path)
    assert run(args) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["concurrency"]
    # the load and the single-request table ran in threads that ended: the main thread computed nothing
    assert "MainThread" not in _threads(tmp_path) and out["thread"].startswith("a worker thread per phase")
    assert [r["concurrency"] for r in rows] == [1, 3]
    for r in rows:
        assert set(r) >= {"concurrency", "lm_tokens_per_s", "audio_seconds_per_s", "first_chunk_p50_ms",
                          "first_chunk_p95_ms", "peak_memory_bytes"}
        assert r["lm_tokens_per_s"] > 0 and r["audio_seconds_per_s"] > 0 and r["peak_memory_bytes"] > 0
        assert 0 <= r["first_chunk_p50_ms"] <= r["first_chunk_p95_ms"]
        # the loop's time over the level's streamed requests only (not the warm-up's, nor the level before)
        assert r["loop_s"] == {k: t * r["concurrency"] for k, t in sorted(FAKE_LOOP.items())}
    assert _calls(tmp_path).count("stream") == 1 + 1 + 3  # a warm-up request, then 1 and 3 at once


def test_concurrency_table_and_bad_counts(capsys):
    run, args = _fake(["--concurrency", "2"])
    assert run(args) == 0
    text = capsys.readouterr().out
    assert "one request at a time" in text
    head = next(line for line in text.splitlines() if line.split()[:2] == ["clients", "wall"])
    assert head.split()[2:] == ["steps", "prefill", "flow", "vocoder", "idle", "other"]
    row = text.splitlines()[text.splitlines().index(head) + 1].split()
    assert [float(x) for x in row[2:]] == [1.5, 0.2, 2.0, 1.0, 0.5, 0.2]  # two requests' worth, "chunk" as other
    with pytest.raises(InvalidRequest, match="positive counts"):
        run(_fake(["--concurrency", "0,2"])[1])
    with pytest.raises(SystemExit):
        _fake(["--concurrency", "two"])


def test_percentile():
    assert bench._percentile([3.0, 1.0, 2.0, 4.0], 50) == pytest.approx(2.5)
    assert bench._percentile([1.0, 2.0, 3.0, 4.0, 5.0], 95) == pytest.approx(4.8)
    assert bench._percentile([7.0], 95) == 7.0


def test_a_read_of_the_step_bytes_is_measured_beside_the_step(capsys, tmp_path):
    from mizuoto.runtime.bench import read_bandwidth_gbs

    assert read_bandwidth_gbs(torch.device("cpu"), 8 << 20, chunk=1 << 20) > 0
    run, args = _fake(["--json"], tmp_path)
    assert run(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["device_read_gb_per_s"] > 0
    assert out["lm_read_fraction"] == pytest.approx(out["lm_achieved_gb_per_s"] / out["device_read_gb_per_s"])

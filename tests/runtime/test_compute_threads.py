"""The compute threads' settings are fixed in one place: a seeded request gives the same bytes everywhere."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mizuoto.errors import InvalidRequest
from mizuoto.runtime import compute_threads
from mizuoto.runtime.api import Runtime
from mizuoto.runtime.threads import in_thread
from mizuoto.testing.cosyvoice_cases import assemble_model_dir
from mizuoto.testing.fixtures import fixtures_root

# One seeded CosyVoice 2 clone; prints the sha256 of its float32 samples. Run as `python -c` with
# argv: model dir, clip; the process never calls torch.set_num_threads itself.
_REQUEST = """
import hashlib, sys
import soundfile, torch
from mizuoto.runtime.api import Runtime
from mizuoto.runtime.engine import Reference, SynthesisRequest

def digest(rt, name, clip):
    samples, rate = soundfile.read(clip, dtype="float32")
    request = SynthesisRequest(text="One seeded request, the same bytes.", seed=7,
                               voice=Reference((torch.from_numpy(samples), rate), "The reference speaker."))
    audio = torch.cat([c.samples for c in rt.synthesize(name, request)])
    return hashlib.sha256(audio.contiguous().numpy().tobytes()).hexdigest()

if __name__ == "__main__":
    rt = Runtime(voices=False)
    print(digest(rt, rt.load(sys.argv[1]), sys.argv[2]))
"""


def _clip() -> Path:
    clips = sorted((fixtures_root() / "frontend").glob("**/*.wav"))
    assert clips, "no frontend clip"
    return clips[0]


@pytest.fixture(scope="module")
def cosy(tmp_path_factory) -> Path:
    found = [d for d in sorted((fixtures_root() / "cosyvoice").glob("*/model")) if (d / "cosyvoice2.yaml").is_file()]
    assert found, "no CosyVoice 2 fixture model"
    return assemble_model_dir(found[0], tmp_path_factory.mktemp("threads") / "cosy")


def test_a_runtime_sets_the_count_asked_the_environments_or_torchs(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.delenv(compute_threads.THREADS_ENV, raising=False)
    assert Runtime(plugins=False, voices=False).threads == torch.get_num_threads()
    monkeypatch.setenv(compute_threads.THREADS_ENV, "3")
    assert Runtime(plugins=False, voices=False).threads == 3
    assert Runtime(plugins=False, voices=False, threads=1).threads == 1
    assert calls == [torch.get_num_threads(), 3, 1]  # always called: the call turns MKL's dynamic threads off
    for bad in ("0", "two", "1.5"):
        monkeypatch.setenv(compute_threads.THREADS_ENV, bad)
        with pytest.raises(InvalidRequest, match="MIZUOTO_THREADS"):
            Runtime(plugins=False, voices=False)
    with pytest.raises(InvalidRequest, match="threads"):
        compute_threads.requested(-2)


def test_set_compute_threads_reaches_later_runtimes_and_children(monkeypatch):
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    monkeypatch.delenv(compute_threads.THREADS_ENV, raising=False)
    assert compute_threads.set_compute_threads(5) == 5
    assert Runtime(plugins=False, voices=False).threads == 5
    done = subprocess.run([sys.executable, "-c", "import os; print(os.environ['MIZUOTO_THREADS'])"],
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "5"


def test_a_seeded_request_gives_the_same_bytes_in_a_fresh_process_a_thread_and_after_other_work(cosy):
    """Here (the suite's process), in a worker thread, after another request, and in a fresh process at the same count."""
    namespace: dict = {}
    exec(compile(_REQUEST, "request", "exec"), namespace)
    digest = namespace["digest"]
    with Runtime(voices=False) as rt:
        name = rt.load(cosy)
        here = digest(rt, name, _clip())
        assert in_thread(lambda: digest(rt, name, _clip())) == here, "in a worker thread"
        other = namespace["SynthesisRequest"](text="Something else first, and a little longer than that.", seed=3,
                                              voice=namespace["Reference"](_clip(), "The reference speaker."))
        assert sum(c.samples.numel() for c in rt.synthesize(name, other)) > 0
        torch.randn(300, 700).matmul(torch.randn(700, 200))  # other torch work in this thread too
        assert digest(rt, name, _clip()) == here, "after other work"
    fresh = subprocess.run([sys.executable, "-c", _REQUEST, str(cosy), str(_clip())], capture_output=True,
                           text=True, timeout=600)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert fresh.stdout.strip().splitlines()[-1] == here, "in a fresh process"

"""The toy batched LM (mizuoto.testing.toy_lm) meets the engine contract one request at a time and batched,
its batched requests share steps and speak as they do alone, and at width 1 it never makes a batch.

The contract suite runs here on two directories of the toy LM, one loaded as `compute.batch=1` and one as
`compute.batch=4` (the suite's CONTRACT_OPTIONS).
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import threading
from pathlib import Path

import pytest
import torch

from mizuoto.runtime.api import Runtime
from mizuoto.runtime.engine import SynthesisRequest
from mizuoto.testing.contract import *  # noqa: F401,F403  (the tests and their parametrization)
from mizuoto.testing.toy_lm import CHUNK_TOKENS, NOTE_SECONDS, ToyLMEngine, write_model

_TMP = Path(tempfile.mkdtemp(prefix="mizuoto-toylm-"))
atexit.register(shutil.rmtree, _TMP, ignore_errors=True)
# a parent of a fixed name: the case id (parent/name) is the same in every process (pytest-xdist workers)
WIDTHS = {1: write_model(_TMP / "batch1" / "toylm"), 4: write_model(_TMP / "batch4" / "toylm")}
CONTRACT_ENGINES = ["toylm"]
CONTRACT_MODELS = list(WIDTHS.values())
# the width-4 directory runs in its continuous batch: the contract's concurrency and cancel checks there
CONTRACT_OPTIONS = {WIDTHS[1]: {}, WIDTHS[4]: {"compute": {"batch": 4}}}.get
TEXTS = ("Hello world, this is a test.", "Four requests at once.", "Each row its own cache.", "Same width, same bits.")


def _audio(rt: Runtime, name: str, request: SynthesisRequest) -> torch.Tensor:
    return torch.cat([c.samples for c in rt.synthesize(name, request)])


def test_batched_requests_equal_each_alone_and_share_steps(tmp_path):
    """At width 4, four seeded requests at once each give the audio they give alone, in fewer steps than tokens."""
    with Runtime(voices=False) as rt:
        name = rt.load(write_model(tmp_path / "toylm"), compute={"batch": 4})
        model = rt.model(name)
        batch = model.batch_loop()
        assert model.batch_width == 4 and batch is not None and batch.width == 4
        requests = [SynthesisRequest(text, voice="low", seed=seed) for text, seed in zip(TEXTS, (1, 2, 3, 4))]
        alone = [_audio(rt, name, r) for r in requests]
        steps = batch.stats()["steps"]
        together: list = [None] * len(requests)
        start = threading.Barrier(len(requests))

        def run(i: int) -> None:
            start.wait(10)
            together[i] = _audio(rt, name, requests[i])
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "the batched requests did not finish within 120 s"
        for i, (a, b) in enumerate(zip(alone, together)):
            assert torch.equal(a, b), f"request {i} speaks differently beside the others"
        tokens = sum(a.numel() for a in together) // int(NOTE_SECONDS * model.rate)  # a note per token
        shared = batch.stats()["steps"] - steps
        assert 0 < shared < tokens, f"{shared} steps for {tokens} tokens: the requests did not share steps"


@pytest.mark.parametrize("width", [1, 4])
def test_streaming_speaks_the_same_audio_in_chunks(tmp_path, width):
    """stream=True gives the audio of stream=False, a chunk every CHUNK_TOKENS tokens, alone and batched."""
    with Runtime(voices=False) as rt:
        name = rt.load(write_model(tmp_path / "toylm"), compute={"batch": width})
        whole = _audio(rt, name, SynthesisRequest(TEXTS[0], voice="high", seed=5))
        chunks = list(rt.synthesize(name, SynthesisRequest(TEXTS[0], voice="high", seed=5, stream=True)))
    note = int(NOTE_SECONDS * 16000)
    assert torch.equal(torch.cat([c.samples for c in chunks]), whole)
    assert [c.samples.numel() for c in chunks[:-1]] == [CHUNK_TOKENS * note] * (len(chunks) - 1)
    assert len(chunks) == -(-whole.numel() // (CHUNK_TOKENS * note))


def test_one_request_at_a_time_never_makes_a_batch(tmp_path):
    """At compute.batch=1 the runtime runs the token loop alone: no batch loop is ever made."""
    with Runtime(voices=False) as rt:
        name = rt.load(write_model(tmp_path / "toylm"))
        model = rt.model(name)
        assert model.batch_width == 1
        _audio(rt, name, SynthesisRequest(TEXTS[0], voice="low", seed=1))
        assert model.batch_loop() is None


def test_outside_a_runtime_the_model_runs_alone(tmp_path):
    """Loaded by the engine itself, with no runtime around it, the model computes each stage where it is."""
    model = ToyLMEngine().load(write_model(tmp_path / "toylm"), None)
    with Runtime(voices=False) as rt:
        expected = _audio(rt, rt.load(tmp_path / "toylm"), SynthesisRequest(TEXTS[1], voice="low", seed=9))
    request = SynthesisRequest(TEXTS[1], mode="preset", voice="low", seed=9)
    assert torch.equal(torch.cat([c.samples for c in model.synthesize(request)]), expected)
    model.close()

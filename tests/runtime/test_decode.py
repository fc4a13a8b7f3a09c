"""A continuous batch's graphed step (runtime.decode.BatchStep) on the CPU.

Uncaptured it is `Decoder.step_rows` + the head; captured it must compute the same, bit for
bit. Its captured form is checked here with a stand-in for a CUDA graph that behaves like one (a replay
reruns the captured function on the static inputs and overwrites the static outputs): that
exercises the static buffers, their chaining from graph to graph and the recapture after the
weights move, which a real GPU run (scripts/gpu_check.py) then confirms.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import mizuoto.runtime.decode as decode
import mizuoto.runtime.graphs as graphs
from mizuoto.nn.lm.decoder import DecoderConfig, Decoder
from mizuoto.runtime.batching import DecodeBatcher
from mizuoto.runtime.decode import BatchStep
from mizuoto.runtime.graphs import GraphedCallable

WIDTH = 4


def _decoder(layers: int) -> Decoder:
    torch.manual_seed(0)
    cfg = DecoderConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=50)
    dec = Decoder(cfg).eval()
    with torch.no_grad():
        for p in dec.parameters():
            p.normal_(0, 0.2)
    return dec


def _head(dec: Decoder):
    return lambda h: dec.logits(h[:, -1]).log_softmax(dim=-1).squeeze(0)


def _caches(dec: Decoder, kinds: list[str | None], seed: int) -> list:
    """One cache per row (None: an empty row), each prefilled with its own random prompt."""
    g = torch.Generator().manual_seed(seed)
    caches = []
    for r, kind in enumerate(kinds):
        if kind is None:
            caches.append(None)
            continue
        cache = dec.new_cache(kind, 40)
        dec(torch.randn(1, 3 + 2 * r, 64, generator=g), cache)
        caches.append(cache)
    return caches


def _steps(step, dec: Decoder, caches: list, n: int, join_at: int | None = None,
           leave_at: int | None = None) -> list[torch.Tensor]:
    """n steps; each row's next input is the embedding of its argmax; an empty row joins at `join_at`,
    the first row leaves at `leave_at`."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(WIDTH, 1, 64, generator=g)
    out = []
    for i in range(n):
        if i == join_at:
            empty = caches.index(None)
            caches[empty] = dec.new_cache("dynamic")
            dec(torch.randn(1, 5, 64, generator=g), caches[empty])
        if i == leave_at:
            caches[0] = None
        scores = step(x, caches).clone()
        out.append(scores)
        x = torch.stack([dec.embed_tokens.weight[int(s.argmax())] for s in scores]).reshape(WIDTH, 1, 64)
        x[[c is None for c in caches]] = 0  # as the batch loop feeds an empty row
    return out


def _reference(dec: Decoder):
    head = _head(dec)
    return lambda x, caches: head(dec.step_rows(x, caches)).reshape(WIDTH, -1)


KINDS = ["dynamic", None, "static", "dynamic"]


@pytest.mark.parametrize("layers", [1, 3])
@torch.inference_mode()
def test_off_cuda_the_batch_step_is_step_rows(layers):
    dec = _decoder(layers)
    step = BatchStep(dec, _head(dec), WIDTH, graphs=True)  # off CUDA: nothing to capture
    ref_caches, caches = _caches(dec, KINDS, 1), _caches(dec, KINDS, 1)
    want = _steps(_reference(dec), dec, ref_caches, 6, join_at=2)
    got = _steps(step, dec, caches, 6, join_at=2)
    assert not step.captured and step.captures == 0
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert [c.length for c in caches] == [c.length for c in ref_caches]
    assert len({int(s.argmax()) for t in got for s in t}) > 3  # the rows go somewhere


class _Replay:
    """Stands in for a captured CUDA graph: a replay reruns the function and overwrites the static outputs."""

    def __init__(self, graphed: GraphedCallable) -> None:
        self.graphed = graphed

    def replay(self) -> None:
        fresh = self.graphed.fn(*self.graphed._args())
        for static, new in zip(_flat(self.graphed.outputs), _flat(fresh)):
            static.copy_(new)


def _flat(x):
    return [x] if isinstance(x, torch.Tensor) else [t for y in x for t in _flat(y)]


@pytest.fixture
def stand_in_graphs(monkeypatch):
    """GraphedCallable 'captures' on the CPU: static outputs, replays that write into them."""
    def capture(self, device, warmup, pool):
        out = self.fn(*self._args())
        self.outputs = out.clone() if isinstance(out, torch.Tensor) else type(out)(t.clone() for t in out)
        self.graph = _Replay(self)

    monkeypatch.setattr(graphs, "unavailable_reason", lambda device: None)
    monkeypatch.setattr(decode, "unavailable_reason", lambda device: None)
    monkeypatch.setattr(decode, "new_pool", lambda device=None: None)
    monkeypatch.setattr(GraphedCallable, "_capture", capture)


@pytest.mark.parametrize("layers", [1, 3])
@torch.inference_mode()
def test_captured_batch_step_is_step_rows(stand_in_graphs, layers):
    dec = _decoder(layers)
    step = BatchStep(dec, _head(dec), WIDTH)
    ref_caches, caches = _caches(dec, KINDS, 2), _caches(dec, KINDS, 2)
    want = _steps(_reference(dec), dec, ref_caches, 7, join_at=2, leave_at=4)
    got = _steps(step, dec, caches, 7, join_at=2, leave_at=4)
    assert step.captured and step.captures == 1
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert [c and c.length for c in caches] == [c and c.length for c in ref_caches]


@torch.inference_mode()
def test_a_batch_step_captures_again_after_its_weights_move(stand_in_graphs):
    dec = _decoder(2)
    step, ref = BatchStep(dec, _head(dec), WIDTH), _reference(dec)
    caches, ref_caches = _caches(dec, KINDS, 3), _caches(dec, KINDS, 3)
    x = torch.randn(WIDTH, 1, 64, generator=torch.Generator().manual_seed(4))
    layer = dec.layers[1].mlp.down_proj
    for move in (False, False, True, False):
        if move:  # what moving a stage to another device and back does to a parameter's storage
            layer.weight.data = layer.weight.data.clone()
        assert torch.equal(step(x, caches), ref(x, ref_caches))
    assert step.captured and step.captures == 2


def test_the_batch_captures_its_steps_only_when_asked():
    dec = _decoder(2)
    for asked in (True, False):
        batcher = DecodeBatcher(dec, _head(dec), WIDTH, contextlib.nullcontext, sampler=None, cuda_graphs=asked)
        assert isinstance(batcher.batch_step, BatchStep) and batcher.batch_step.graphs is asked
        batcher.close()


@torch.inference_mode()
def test_a_batch_step_whose_capture_fails_runs_eagerly(monkeypatch):
    def refuse(self, device, warmup, pool):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "unavailable_reason", lambda device: None)
    monkeypatch.setattr(decode, "unavailable_reason", lambda device: None)
    monkeypatch.setattr(decode, "new_pool", lambda device=None: None)
    monkeypatch.setattr(GraphedCallable, "_capture", refuse)
    dec = _decoder(3)
    step = BatchStep(dec, _head(dec), WIDTH)
    ref_caches, caches = _caches(dec, KINDS, 5), _caches(dec, KINDS, 5)
    want = _steps(_reference(dec), dec, ref_caches, 4)
    got = _steps(step, dec, caches, 4)
    assert not step.captured and step.captures == 1 and step.segments == []  # tried once, not again
    assert all(torch.equal(a, b) for a, b in zip(got, want))

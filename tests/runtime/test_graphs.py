"""CUDA-graph helpers off CUDA: a logged no-op that runs the same code eagerly, with the same results."""

from __future__ import annotations

import logging

import pytest
import torch

from mizuoto.runtime.graphs import GraphedCallable, new_pool, unavailable_reason, use_cuda_graphs
from mizuoto.runtime.decode import DecodeSteps, GraphDecodeStep, GraphDraw
from mizuoto.nn.lm.decoder import DecoderConfig, Decoder
from mizuoto.nn.lm.sampling import FastSampler


def test_cpu_has_a_reason_and_the_option_is_a_logged_no_op(caplog):
    reason = unavailable_reason("cpu")
    assert reason and "cpu" in reason
    with caplog.at_level(logging.WARNING, logger="mizuoto.runtime.graphs"):
        assert use_cuda_graphs(True, "cpu", what="the LM") is False
    assert any("compute.cuda_graphs" in r.message and "the LM" in r.message and "cpu" in r.message
               for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mizuoto.runtime.graphs"):
        assert use_cuda_graphs(False, "cpu") is False
        assert use_cuda_graphs(True, "cpu", why_not="the LM is split across devices") is False
    assert [r.message for r in caplog.records] == [
        "compute.cuda_graphs is on but has no effect for the model: the LM is split across devices; running eagerly"]
    assert new_pool("cpu") is None


def test_graphed_callable_runs_eagerly_off_cuda():
    calls = []

    def fn(a, b):
        calls.append(1)
        return a * b, (a + b,)

    a, b = torch.arange(3.0), torch.full((3,), 2.0)
    g = GraphedCallable(fn, [a, b], warmup=3)
    assert not g.captured and g.reason and not calls  # no warm-up, no capture
    prod, (total,) = g(a + 1, b)
    assert torch.equal(prod, (a + 1) * b) and torch.equal(total, a + 1 + b) and len(calls) == 1
    assert GraphedCallable(fn, [a, b], enabled=False).reason == "disabled"


def test_graphed_callable_passes_the_generator_when_random():
    def fn(x, generator):
        return x + torch.empty_like(x).exponential_(1, generator=generator)

    g = GraphedCallable(fn, [torch.zeros(4)], random=True)
    got = g(torch.zeros(4), generator=torch.Generator().manual_seed(3))
    want = torch.empty(4).exponential_(1, generator=torch.Generator().manual_seed(3))
    assert torch.equal(got, want)


def _tiny_decoder(tie: bool) -> Decoder:
    torch.manual_seed(0)
    cfg = DecoderConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=50, tie_word_embeddings=tie)
    dec = Decoder(cfg).eval()
    with torch.no_grad():
        for p in dec.parameters():
            p.normal_(0, 0.2)
    return dec


@pytest.mark.parametrize("tie", [True, False])
def test_decode_step_equals_the_decoders_forward(tie):
    dec = _tiny_decoder(tie)
    head = lambda h: dec.logits(h[:, -1]).log_softmax(dim=-1).squeeze(0)  # noqa: E731
    prompt = torch.randn(1, 7, 64, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref_cache, cache = dec.new_cache("static", 20), dec.new_cache("static", 20)
        dec(prompt, ref_cache)
        dec(prompt, cache)
        step = GraphDecodeStep(dec, cache, head, graphs=True)
        assert not step.captured
        x = prompt[:, -1:]
        for _ in range(13):
            want = head(dec(x, ref_cache))
            got = step(x)
            assert torch.equal(got, want)
            assert cache.length == ref_cache.length
            x = dec.embed_tokens.weight[int(got.argmax())].reshape(1, 1, -1)
        assert torch.equal(cache.k, ref_cache.k) and torch.equal(cache.v, ref_cache.v)
        with pytest.raises(RuntimeError, match="overflow"):
            step(x)
    with pytest.raises(TypeError, match="StaticKVCache"):
        GraphDecodeStep(dec, dec.new_cache("dynamic"), head)


def test_graph_draw_off_cuda_is_the_fast_sampler():
    scores = torch.randn(300, generator=torch.Generator().manual_seed(2)).mul(3).log_softmax(0)
    for kind in ("ras_sampling", "nucleus_sampling", "random_sampling"):
        sampler = FastSampler(kind=kind)
        draw = GraphDraw(sampler, scores)
        assert not draw.captured
        for seed in range(5):
            decoded = [seed, 1, 2]
            a, b = scores.clone(), scores.clone()
            ga, gb = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
            assert draw(a, decoded, ga) == sampler(b, decoded, gb)
            assert torch.equal(ga.get_state(), gb.get_state()) and torch.equal(a, b)


def test_a_capture_that_fails_falls_back_to_eager(monkeypatch, caplog):
    import mizuoto.runtime.graphs as graphs
    import mizuoto.runtime.decode as graph_step

    def refuse(self, device, warmup, pool):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "unavailable_reason", lambda device: None)
    monkeypatch.setattr(graph_step, "unavailable_reason", lambda device: None)
    monkeypatch.setattr(graphs, "new_pool", lambda device=None: None)
    monkeypatch.setattr(graph_step, "new_pool", lambda device=None: None)
    monkeypatch.setattr(GraphedCallable, "_capture", refuse)
    with caplog.at_level(logging.WARNING, logger="mizuoto.runtime.graphs"):
        g = GraphedCallable(lambda a: a * 2, [torch.ones(2)], name="doubling")
    assert not g.captured and "capture failed" in g.reason
    assert any("doubling runs eagerly" in r.message for r in caplog.records)
    assert torch.equal(g(torch.full((2,), 3.0)), torch.full((2,), 6.0))

    dec = _tiny_decoder(True)
    head = lambda h: dec.logits(h[:, -1]).log_softmax(dim=-1).squeeze(0)  # noqa: E731
    prompt = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref_cache, cache = dec.new_cache("static", 8), dec.new_cache("static", 8)
        dec(prompt, ref_cache)
        dec(prompt, cache)
        step = GraphDecodeStep(dec, cache, head)
        assert not step.captured and step.output is None
        x = prompt[:, -1:]
        assert torch.equal(step(x), head(dec(x, ref_cache)))


def _decode(steps: DecodeSteps, dec: Decoder, prompt: torch.Tensor, n: int, generator) -> list[int]:
    out: list[int] = []
    x = prompt
    with torch.inference_mode():
        for i in range(n):
            scores = steps.scores(x)
            if i < 3:
                scores[0] = -float("inf")  # as an engine suppresses its stop id early on
            token = steps.draw(scores, out, generator)
            out.append(token)
            x = dec.embed_tokens.weight[token].reshape(1, 1, -1)
    return out


def test_decode_steps_with_the_fast_sampler_give_upstreams_tokens(caplog):
    from mizuoto.engines.cosyvoice.sampling import Sampler  # upstream's loop, as the engine runs it

    dec = _tiny_decoder(True)
    dec.embed_tokens.weight.data.mul_(0.3)  # flatter logits: nucleus sizes and repetitions vary
    head = lambda h: dec.logits(h[:, -1]).log_softmax(dim=-1).squeeze(0)  # noqa: E731
    prompt = torch.randn(1, 6, 64, generator=torch.Generator().manual_seed(4))
    runs = {}
    for name, fast, cache in [("upstream", False, "dynamic"), ("fast", True, "static"), ("fast-dynamic", True, "dynamic")]:
        with caplog.at_level(logging.WARNING, logger="mizuoto.runtime.graphs"):
            steps = DecodeSteps(dec, dec.new_cache(cache, 60), head, Sampler(), cuda_graphs=True, fast=fast)
        assert not steps.graphs
        g = torch.Generator().manual_seed(9)
        runs[name] = (_decode(steps, dec, prompt, 50, g), g.get_state())
    assert runs["fast"][0] == runs["upstream"][0] == runs["fast-dynamic"][0]
    assert torch.equal(runs["fast"][1], runs["upstream"][1])
    assert len(set(runs["fast"][0])) > 5
    assert sum("compute.cuda_graphs" in r.message for r in caplog.records) == 3

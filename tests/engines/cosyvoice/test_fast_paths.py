"""The engine's fast-path options on the CPU: cuda_graphs (a logged no-op), fp16 (fp32 + warning), compile.

Off CUDA the LM must stay exactly upstream's loop whatever the options, so the recorded tokens
are the target; compile changes float rounding only, within a documented tolerance.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import pytest
import torch

from mizuoto.engines.cosyvoice.engine import CosyVoiceEngine
from mizuoto.engines.cosyvoice.llm import VARIANTS, QwenSpeechLM
from mizuoto.engines.cosyvoice.synthesis import request_generators
from mizuoto.engines.cosyvoice.variants import find_variant, load_config
from mizuoto.errors import MizuotoError
from mizuoto.runtime.options import parse_options
from mizuoto.testing.cosyvoice_cases import assemble_model_dir, bistream_text, list_cases, load_case
from mizuoto.testing.cpu_recordings import FLOW_MEL, tree_comparison

CASES = list_cases()


@functools.cache
def _is_qwen(model_dir: Path) -> bool:
    config = load_config(model_dir, find_variant(model_dir))
    return getattr(config["llm"], "cls", None) in VARIANTS


# Qwen LM cases with recorded tokens, decoded in one piece (non-streaming requests)
LM_CASES = [r for r in CASES if r.has("lm.tokens_raw", "input.text") and _is_qwen(r.model_dir)
            and not load_case(r).meta["stream"]]
# one small v2/v3 case whose first flow call was recorded (for compile and fp16)
FLOW_CASES = sorted((r for r in CASES if r.has("flow.0.mel", "flow.0.token") and _is_qwen(r.model_dir)
                     and "source_speech_token" not in load_case(r).meta["model_input_keys"]),
                    key=lambda r: (load_case(r)["flow.0.token"].numel(), r.id))
_MODELS: dict[tuple, object] = {}


def test_cases_were_found():
    assert LM_CASES and FLOW_CASES


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    def get(model_dir: Path, **options):
        key = (model_dir, tuple(sorted(options.items())))
        if key not in _MODELS:
            dest = tmp_path_factory.mktemp(model_dir.parent.name)
            dest = assemble_model_dir(model_dir, dest)
            _MODELS[key] = CosyVoiceEngine().load(dest, parse_options({"device": "cpu", **options}))
        return _MODELS[key]
    yield get
    _MODELS.clear()


def _tokens(lm: QwenSpeechLM, case, **kwargs) -> list[int]:
    return list(lm.generate(case.input("text"), case.input("prompt_text"), case.input("llm_prompt_speech_token"),
                            generator=torch.Generator().manual_seed(case.seed), **kwargs))


@pytest.mark.parametrize("ref", LM_CASES, ids=[r.id for r in LM_CASES])
def test_cuda_graphs_off_cuda_keeps_upstreams_tokens(model, ref, caplog):
    """With the option on, a CPU load logs why it has no effect and draws upstream's tokens."""
    case = load_case(ref)
    m = model(ref.model_dir, **{"compute.cuda_graphs": True, "compute.kv_cache": "static"})
    assert m._graphs_arg == {"cuda_graphs": False}
    want = case["lm.tokens_raw"].to(torch.int32).flatten().tolist()
    for cache in ("dynamic", "static"):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert _tokens(m.llm, case, cache=cache, cuda_graphs=True) == want, cache
        # asked directly (not through the engine), the LM itself says why
        assert any("cuda_graphs" in r.getMessage() for r in caplog.records)


def test_cuda_graphs_option_logs_why_at_load(tmp_path, caplog):
    """A CPU load with compute.cuda_graphs says once that (and why) it has no effect."""
    dest = assemble_model_dir(LM_CASES[0].model_dir, tmp_path / "model")
    with caplog.at_level(logging.WARNING):
        m = CosyVoiceEngine().load(dest, parse_options({"device": "cpu", "compute.cuda_graphs": True,
                                                        "compute.kv_cache": "static"}))
    assert m._graphs_arg == {"cuda_graphs": False}
    assert [r for r in caplog.records if "cuda_graphs" in r.getMessage() and "cpu" in r.getMessage()]


@pytest.mark.parametrize("ref", LM_CASES[:1], ids=[r.id for r in LM_CASES[:1]])
def test_lm_off_cuda_is_upstreams_loop(model, ref):
    """Off CUDA the decode steps use the engine's own (upstream) sampler and no graphs."""
    lm = model(ref.model_dir).llm
    steps = lm._steps(cuda_graphs=True).attach(lambda: lm.llm.new_cache("static", 64))._steps  # run by itself
    assert steps.sampler is lm.sampler and not steps.graphs and steps.step is None


BISTREAM_CASES = list({r.model_dir: r for r in reversed(LM_CASES) if r.has("input.prompt_text")}.values())


@pytest.mark.parametrize("ref", BISTREAM_CASES, ids=[r.id for r in BISTREAM_CASES])
def test_bistream_with_cuda_graphs_off_cuda(model, ref):
    """Streamed text in: the option changes nothing on the CPU either (the same tokens, and the same
    upstream special-token stop, if the tiny LM draws one, after the same tokens)."""
    case = load_case(ref)
    lm = model(ref.model_dir).llm
    prompt = case.input("llm_prompt_speech_token")  # instruct2 gives the LM no prompt speech
    text = bistream_text(case.input("text"), case.input("prompt_text"), 0 if prompt is None else prompt.shape[1], 3,
                         lm.mix_ratio)
    pieces = [text[:, i:i + 3] for i in range(0, text.shape[1], 3)]

    def run(**kw):
        out = []
        try:
            for token in lm.generate_bistream(iter(pieces), case.input("prompt_text"),
                                              case.input("llm_prompt_speech_token"),
                                              generator=torch.Generator().manual_seed(7), cache="static",
                                              cache_len=4096, **kw):
                out.append(token)
        except MizuotoError as exc:  # only upstream's special-token stop is an expected outcome
            assert "special token" in str(exc), exc
            out.append(str(exc))
        return out
    plain = run()
    assert plain, "no token and no error"
    assert run(cuda_graphs=True) == plain


def _flow_args(case):
    inputs = {k: case.input(k) for k in case.meta["model_input_keys"]}
    return (case["flow.0.token"].to(torch.int32), inputs["flow_prompt_speech_token"], inputs["prompt_speech_feat"],
            inputs["flow_embedding"])


def _flow(m, case) -> torch.Tensor:
    call = case.meta["flow_calls"][0]
    token, prompt_token, prompt_feat, embedding = _flow_args(case)
    inputs = {"flow_prompt_speech_token": prompt_token, "prompt_speech_feat": prompt_feat, "flow_embedding": embedding}
    mel, _ = m.synthesizer().mel(token, inputs, streaming=call["streaming"], finalize=call["finalize"], cache=None,
                                 generator=torch.Generator().manual_seed(case.seed))
    return mel


def test_compile_keeps_the_mel_within_tolerance(model):
    """compute.compile: the flow estimator under torch.compile (inductor, C++ on the CPU).

    Measured on this machine (2 vCPU AMD EPYC, torch 2.13.0 CPU) on the smallest recorded v2/v3
    flow call: max |compiled - eager| = 9.7e-6 with max |mel| = 5.9, i.e. about 20 float32 ulps at
    that magnitude, from inductor's fused and reordered reductions over the 10 ODE steps. The
    tolerance is 2.5e-6 relative to the mel's largest magnitude (1.5e-5 there; measured 1.6e-6); eager stays equal
    to upstream (on a CPU class the cases were not recorded on: within upstream's own flow mel spread,
    mizuoto.testing.cpu_recordings). The compiled mel is compared with the eager one, not a recording.
    """
    ref = FLOW_CASES[0]
    case = load_case(ref)
    eager = _flow(model(ref.model_dir), case)
    tree_comparison("cosyvoice").assert_equal(eager, case["flow.0.mel"], FLOW_MEL,
                                              f"{ref.id} eager flow mel")
    m = model(ref.model_dir, **{"compute.compile": True})
    est = m.flow.decoder.estimator
    assert getattr(est, "_compiled_call_impl", None) is not None, "the estimator was not compiled"
    compiled = _flow(m, case)
    assert compiled.shape == eager.shape
    err = (compiled - eager).abs().max().item()
    assert err <= 2.5e-6 * eager.abs().max().item(), err
    # parameter names are unchanged (Module.compile works in place)
    assert set(m.flow.state_dict()) == set(model(ref.model_dir).flow.state_dict())


def test_fp16_on_the_cpu_warns_and_runs_fp32(model, caplog):
    """precision=fp16 off CUDA: upstream's fp16 is CUDA autocast; here a warning and fp32 audio."""
    ref = FLOW_CASES[0]
    case = load_case(ref)
    with caplog.at_level(logging.WARNING):
        half = model(ref.model_dir, precision="fp16")
    assert any("fp16" in r.getMessage() and "fp32" in r.getMessage() for r in caplog.records)
    full = model(ref.model_dir)
    assert half.llm.llm.embed_tokens.weight.dtype == torch.float32
    inputs = {k: case.input(k) for k in case.meta["model_input_keys"]}
    outs = []
    for m in (full, half):
        lm_gen, voc_gen = request_generators(case.seed, False, True)
        outs.append(list(m.synthesizer().run(inputs, stream=False, speed=1.0, lm_gen=lm_gen, voc_gen=voc_gen)))
    assert len(outs[0]) == len(outs[1]) >= 1
    for a, b in zip(*outs):
        assert torch.equal(a, b)

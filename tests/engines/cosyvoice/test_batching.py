"""Batched LM decoding (compute.batch > 1): a seeded request's tokens and audio do not depend on its company.

Every LM case the tree holds is run in a batch of width 8: alone, then beside 1 to 7 other
requests (the other cases' inputs, i.e. other lengths, with other seeds), streaming and not. Its
tokens and its audio must be identical across all those compositions. How often the batched
tokens differ from the unbatched (upstream's) ones is printed; it is a property of the model's
sizes, not asserted.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import torch

from mizuoto.engines.cosyvoice.engine import CosyVoiceEngine
from mizuoto.engines.cosyvoice.llm import VARIANTS
from mizuoto.engines.cosyvoice.synthesis import request_generators
from mizuoto.errors import MizuotoError
from mizuoto.runtime.hyperyaml import load_hyperyaml
from mizuoto.runtime.options import parse_options
from mizuoto.testing.cosyvoice_cases import assemble_model_dir, first_speaking_seed, list_cases, load_case

WIDTH = 8
# LM cases (text to speak, recorded tokens); voice conversion has no LM
LM_REFS = [r for r in list_cases() if r.has("lm.tokens_raw", "input.text")]
_MODELS: dict[tuple[Path, int], object] = {}


@pytest.fixture(scope="module")
def model_of(tmp_path_factory):
    def get(model_dir: Path, batch: int = WIDTH):
        if (model_dir, batch) not in _MODELS:
            dest = assemble_model_dir(model_dir, tmp_path_factory.mktemp(model_dir.parent.name))
            _MODELS[model_dir, batch] = CosyVoiceEngine().load(dest, parse_options(device="cpu", compute_batch=batch))
        return _MODELS[model_dir, batch]
    yield get
    for m in _MODELS.values():
        m.close()
    _MODELS.clear()


def _inputs(case) -> dict:
    return {k: case.input(k) for k in case.meta["model_input_keys"]}


def _request(model, inputs: dict, seed: int, stream: bool, batched: bool = True) -> tuple[list[int], torch.Tensor]:
    tokens: list[int] = []
    synth = model.synthesizer(batched=batched)
    synth.on_tokens = tokens.extend
    lm_gen, voc_gen = request_generators(seed, stream, True)
    audio = torch.cat([c.flatten() for c in synth.run(inputs, stream=stream, speed=1.0, lm_gen=lm_gen,
                                                     voc_gen=voc_gen)])
    return tokens, audio


def _together(model, jobs: list[tuple[dict, int, bool]], raises: bool = True) -> list:
    """Every job started at once in its own thread (as the server's jobs run); results in job order.

    With `raises=False` a job's MizuotoError is its result (an LM upstream also stops with an
    error is an outcome to compare, not a failure of the test).
    """
    out: list = [None] * len(jobs)
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(jobs))

    def run(i: int) -> None:
        try:
            barrier.wait()
            out[i] = _request(model, *jobs[i])
        except MizuotoError as e:
            if raises:
                errors.append(e)
            out[i] = e
        except BaseException as e:  # re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    if errors:
        raise errors[0]
    return out


def _qwen(ref) -> bool:
    return load_hyperyaml(ref.yaml_path)["llm"].cls in VARIANTS


BATCHED_REFS = [r for r in LM_REFS if _qwen(r)]
UNBATCHED_DIRS = sorted({r.model_dir for r in LM_REFS if not _qwen(r)})


def test_cases_were_found():
    assert BATCHED_REFS, "no Qwen-LM case in the fixture tree"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("ref", BATCHED_REFS, ids=lambda r: r.id)
def test_a_request_gives_the_same_tokens_and_audio_in_any_company(ref, stream, model_of, capsys):
    case = load_case(ref)
    model = model_of(case.model_dir)
    mine = (_inputs(case), case.seed, stream)
    others = [load_case(r) for r in LM_REFS if r.model_dir == ref.model_dir and r != ref] or [case]
    company = [(_inputs(others[i % len(others)]), case.seed + 101 * (i + 1), i % 2 == 0) for i in range(WIDTH - 1)]
    alone_tokens, alone_audio = _together(model, [mine])[0]
    if case["lm.tokens_raw"].numel():  # upstream's LM spoke for these inputs (a random one may not)
        assert alone_tokens, "the case spoke no token"
    for n in (1, 3, WIDTH - 1):
        tokens, audio = _together(model, [*company[:n], mine])[-1]
        assert tokens == alone_tokens, f"tokens changed beside {n} other requests"
        assert torch.equal(audio, alone_audio), f"audio changed beside {n} other requests"
    solo_tokens, _ = _request(model, _inputs(case), case.seed, stream, batched=False)
    differ = sum(a != b for a, b in zip(alone_tokens, solo_tokens)) + abs(len(alone_tokens) - len(solo_tokens))
    with capsys.disabled():
        print(f"\n[batching] {ref.id} ({'stream' if stream else 'whole'}): batched tokens differ from unbatched"
              f" at {differ} of {len(solo_tokens)} positions")
    stats = model.batch_loop().stats()
    assert stats["active"] == 0 and stats["steps"] > 0, stats


def test_the_rows_of_a_step_are_shared(model_of):
    """Eight requests at once are served by shared steps: fewer steps than tokens."""
    ref = BATCHED_REFS[0]
    case = load_case(ref)
    model = model_of(case.model_dir)
    before = dict(model.batch_loop().stats())
    results = _together(model, [(_inputs(case), case.seed + i, False) for i in range(WIDTH)])
    tokens = sum(len(t) for t, _ in results)
    steps = model.batch_loop().stats()["steps"] - before["steps"]
    spoken = sorted(len(t) for t, _ in results)
    if spoken[-2] > 1:  # at least two spoke on together (a random LM may stop at once for a seed)
        assert steps < tokens, (steps, tokens)
    else:  # at most one row left to step: one step per token, no more
        assert steps <= tokens, (steps, tokens)


@pytest.mark.parametrize("model_dir", UNBATCHED_DIRS, ids=lambda d: d.parent.name)
def test_cosyvoice1_runs_one_request_at_a_time(model_dir, model_of, caplog):
    with caplog.at_level(logging.WARNING, logger="mizuoto.cosyvoice"):
        model = model_of(model_dir, 4)
    assert model.batch_width == 1 and model.batch_loop() is None
    assert "does not batch" in caplog.text


def _streamed(inputs: dict, piece: int = 4) -> dict:
    """The case's text as pieces of `piece` tokens, as streamed text in arrives."""
    text = inputs["text"]
    return {**inputs, "text": iter([text[:, i:i + piece] for i in range(0, text.shape[1], piece)])}


# streamed text in: Qwen2LM's bistream (CosyVoice3LM's raises on the special tokens a tiny random LM
# draws, see conftest.py), on cases with a reference text
BISTREAM_REFS = [r for r in BATCHED_REFS if load_hyperyaml(r.yaml_path)["llm"].cls == "Qwen2LM"
                 and r.has("input.prompt_text")]


@pytest.mark.parametrize("ref", BISTREAM_REFS, ids=lambda r: r.id)
def test_streamed_text_batches_and_keeps_its_tokens(ref, model_of):
    case = load_case(ref)
    model = model_of(case.model_dir)
    # A tiny random LM may end a streamed text at once (eos at its first final step), or draw a
    # special token upstream's bistream rejects too (an error): take the first seed from the
    # case's whose request speaks; if none does, what the case's seed gave must not change either.
    def alone_at(seed: int):
        result = _together(model, [(_streamed(_inputs(case)), seed, True)])[0]
        return result if result[0] else None
    seed, alone = first_speaking_seed(alone_at, case.seed, tries=8)
    company = [(_streamed(_inputs(case), 3 + i), seed + 7 * (i + 1), i % 2 == 0) for i in range(3)]
    beside = _together(model, [*company, (_streamed(_inputs(case)), seed, True)], raises=False)[-1]
    if alone is None:  # eos first for every seed: so beside others
        assert not isinstance(beside, MizuotoError) and beside[0] == [], beside
        return
    if isinstance(alone, MizuotoError):
        assert type(beside) is type(alone) and str(beside) == str(alone), f"alone: {alone!r}, beside: {beside!r}"
        return
    assert not isinstance(beside, MizuotoError), beside
    assert beside[0] == alone[0]
    assert torch.equal(beside[1], alone[1])

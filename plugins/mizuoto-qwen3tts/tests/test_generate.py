"""The frame loop draws upstream's frames: codes, talker tokens, hidden states and number of draws, every case.

Each case's loop starts from its recorded prefill (`talker_inputs_embeds`, `trailing_text_hidden`,
`tts_pad_embed`: checked against upstream by test_prefill.py) with a generator seeded with the
case's seed, and the sampling values upstream's wrapper passed on (`model_generate_kwargs`).
"""

import pytest
import torch

from mizuoto.errors import InvalidRequest
from mizuoto.runtime.sequence import Forward, RowSteps, Sequence
from mizuoto_qwen3tts.code_predictor import load_code_predictor
from mizuoto_qwen3tts.generate import FrameLoop, SamplingOptions
from mizuoto_qwen3tts.ids import ModelIds
from mizuoto_qwen3tts.prefill import Prefill
from mizuoto_qwen3tts.talker import load_talker

OPTION_NAMES = set(SamplingOptions.__dataclass_fields__)


def frame_loop(model_dir) -> FrameLoop:
    """The model dir's talker and code predictor as a frame loop."""
    return FrameLoop(load_talker(model_dir), load_code_predictor(model_dir), ModelIds.from_dir(model_dir))


def recorded_prefill(recorded) -> Prefill:
    """The prefill upstream handed its talker."""
    return Prefill(recorded["talker_inputs_embeds"], recorded["trailing_text_hidden"], recorded["tts_pad_embed"])


def case_options(case) -> SamplingOptions:
    """The sampling values upstream's model got, over the model dir's defaults."""
    given = {k: v for k, v in case.spec["model_generate_kwargs"].items() if k in OPTION_NAMES}
    return SamplingOptions.from_model_dir(case.model_dir, **given)


class Run:
    """What one run of the loop gave: frames, talker tokens, hidden states, draws and how it ended."""

    def __init__(self) -> None:
        self.frames, self.tokens, self.hidden, self.draws, self.stopped = [], [], [], 0, None

    def token(self, token: int, hidden: torch.Tensor) -> None:
        self.tokens.append(token)
        self.hidden.append(hidden.clone())

    def consume(self, loop) -> "Run":
        """Every frame of `loop`, and its return value."""
        while True:
            try:
                self.frames.append(next(loop))
            except StopIteration as end:
                self.stopped = end.value
                return self


def counting_multinomial(monkeypatch, run: Run) -> None:
    original = torch.multinomial

    def multinomial(*args, **kwargs):
        run.draws += 1
        return original(*args, **kwargs)
    monkeypatch.setattr(torch, "multinomial", multinomial)


def check_run(case, recorded, run: Run) -> None:
    codes = recorded["codes"]
    frames = torch.stack(run.frames) if run.frames else torch.zeros(0, codes.shape[1], dtype=torch.int64)
    assert run.tokens == recorded["talker_tokens"].tolist(), f"{case.name}: talker tokens differ"
    assert torch.equal(frames, codes), f"{case.name}: frames differ ({frames.shape[0]} vs {codes.shape[0]})"
    assert run.stopped == case.spec["stopped"]
    case.cpu.assert_equal(torch.stack(run.hidden), recorded["talker_hidden"], "talker_hidden",
                          f"{case.name} talker_hidden")


@pytest.mark.parametrize("static_cache", [False, True], ids=["dynamic-cache", "static-cache"])
@torch.inference_mode()
def test_the_loop_draws_upstreams_frames_tokens_and_hidden_states(case, monkeypatch, static_cache):
    recorded, run = case.tensors(), Run()
    loop = frame_loop(case.model_dir)
    counting_multinomial(monkeypatch, run)
    generator = torch.Generator().manual_seed(case.spec["seed"])
    run.consume(loop.generate(recorded_prefill(recorded), case_options(case), generator, on_token=run.token,
                              static_cache=static_cache))
    check_run(case, recorded, run)
    assert run.draws == case.spec["multinomial_calls"], f"{case.name}: {run.draws} draws"


def test_the_calls_options_over_the_model_dirs_defaults_are_what_upstream_passed_on(case):
    """`from_model_dir` merges as upstream's wrapper does (call > generation_config.json > upstream's defaults)."""
    given = {k: v for k, v in case.kwargs.items() if k in OPTION_NAMES}
    merged = vars(SamplingOptions.from_model_dir(case.model_dir, **given))
    passed = {k: v for k, v in case.spec["model_generate_kwargs"].items() if k in OPTION_NAMES}
    assert passed == merged


class OneRowBatch:
    """A stand-in for the runtime's batch around one row: it answers each `Forward` with the row's own pass."""

    def __init__(self, sequence: Sequence) -> None:
        self.sequence, self.cache = sequence, None

    # the row's side of RowSteps (runtime.batch_rows.Row)
    def attach(self, cache) -> None:
        self.cache = cache

    def compute(self, fn):
        return fn()

    def run(self, loop) -> Run:
        out, answer = Run(), None
        try:
            while True:
                item = loop.send(answer)
                answer = None
                if isinstance(item, Forward):
                    (x,) = item.inputs
                    answer = [self.sequence.row_head(self.sequence.decoder(x, self.cache))]
                else:
                    out.frames.append(item)
        except StopIteration as end:
            out.stopped = end.value
        return out


@torch.inference_mode()
def test_the_loop_runs_as_a_batchs_row(case):
    """`sequence()` is a runtime Sequence the batch can run, and the loop on `RowSteps` draws the same frames."""
    recorded = case.tensors()
    loop = frame_loop(case.model_dir)
    sequence = loop.sequence()
    assert isinstance(sequence, Sequence) and sequence.batches and sequence.rows == 1
    row = OneRowBatch(sequence)
    tokens = []
    generator = torch.Generator().manual_seed(case.spec["seed"])
    run = row.run(loop.generate(recorded_prefill(recorded), case_options(case), generator,
                                steps=RowSteps((row,), sequence), on_token=lambda t, h: tokens.append(t)))
    run.tokens = tokens
    frames = torch.stack(run.frames) if run.frames else recorded["codes"][:0]
    assert tokens == recorded["talker_tokens"].tolist() and torch.equal(frames, recorded["codes"])


@pytest.mark.parametrize("change", [{"temperature": 0.0}, {"top_k": -1}, {"top_p": 1.5}, {"subtalker_top_p": -0.1},
                                    {"repetition_penalty": 0.0}, {"max_new_tokens": 0}, {"nonsense": 1}])
def test_options_transformers_refuses_are_refused(any_case, change):
    with pytest.raises(InvalidRequest):
        SamplingOptions.from_model_dir(any_case.model_dir, **change)


def test_greedy_options_need_no_valid_temperature(any_case):
    """Without sampling transformers builds no warper, so their values are never checked."""
    options = SamplingOptions.from_model_dir(any_case.model_dir, do_sample=False, subtalker_dosample=False,
                                             temperature=0.0, subtalker_top_k=-5)
    assert not options.do_sample and options.temperature == 0.0

"""The engine contract suite: what every registered engine, and every model it loads, must do.

Run it on your own engine (installed so its `mizuoto.engines` entry point is visible):

    MIZUOTO_CONTRACT_MODELS=/path/to/model[:/other/model] MIZUOTO_CONTRACT_ENGINES=myengine \\
        pytest --pyargs mizuoto.testing.contract

or from a test module of your own: set `CONTRACT_MODELS = [...]` (model dirs, or a function
returning them), optionally `CONTRACT_ENGINES = [...]` and `CONTRACT_OPTIONS` (the load options
every model is loaded with, e.g. `{"compute": {"batch": 4}}` to check a model in its continuous
batch, or a function of the model dir giving them), then `from mizuoto.testing.contract import *`. Directories offered by plugins' `mizuoto_example_models` hook are added. Engines named
explicitly must import; by default every importable registered engine is checked, and every
engine checked needs at least one model directory that it detects.

Streaming text in is checked with a fixed sentence and reference by default. A model whose
output depends on its input in a way that sentence does not exercise (e.g. random test weights)
can be given its own deterministic input: `$MIZUOTO_CONTRACT_STREAM_TEXT` names a json file
mapping a model dir to `{"pieces": [...], "ref_audio": path, "ref_text": str, "seed": int}`.
"""

from __future__ import annotations

import contextlib

import functools
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from mizuoto.runtime.api import Runtime
from mizuoto.runtime.engine import (MODES, AudioChunk, Capabilities, Engine, Reference, Stage, SynthesisRequest,
                                    Voice, VoicePrompt, check_request)
from mizuoto.errors import InvalidRequest, MizuotoError
from mizuoto.runtime.memory import Plan, measure, run_groups
from mizuoto.runtime.options import parse_options
from mizuoto.runtime.plugins import default_registry
from mizuoto.runtime.lease import Lease
from mizuoto.runtime.scheduler import Scheduler

ENV_MODELS = "MIZUOTO_CONTRACT_MODELS"
ENV_ENGINES = "MIZUOTO_CONTRACT_ENGINES"
ENV_STREAM_TEXT = "MIZUOTO_CONTRACT_STREAM_TEXT"
TEXT = "Hello world, this is a test."
REF_TEXT = "A short reference sentence."


@dataclass(frozen=True)
class Case:
    """One model directory of one engine, loaded with `options` (load options as json; "{}": the defaults)."""

    engine: str
    model_dir: Path
    options: str = "{}"

    def __str__(self) -> str:
        given = json.loads(self.options)
        return f"{self.engine}:{self.model_dir.parent.name}/{self.model_dir.name}" + (f"[{self.options}]" if given else "")

    def load_options(self) -> dict:
        """The load options the case's model is loaded with."""
        return json.loads(self.options)


def _wanted_engines(module) -> list[str]:
    """The engines CONTRACT_ENGINES and $MIZUOTO_CONTRACT_ENGINES name, else every importable registered one."""
    names = list(getattr(module, "CONTRACT_ENGINES", ()) or ())
    names += [n for n in os.environ.get(ENV_ENGINES, "").split(",") if n.strip()]
    return sorted(set(n.strip() for n in names)) if names else sorted(default_registry().load_all())


def _model_dirs(module) -> list[Path]:
    """CONTRACT_MODELS of the test module, $MIZUOTO_CONTRACT_MODELS, and the plugins' example models."""
    dirs = getattr(module, "CONTRACT_MODELS", ()) or ()
    dirs = list(dirs() if callable(dirs) else dirs)
    dirs += [p for p in os.environ.get(ENV_MODELS, "").split(os.pathsep) if p]
    dirs += default_registry().example_models()
    return list(dict.fromkeys(Path(d) for d in dirs))


def _detects(name: str, model_dir: Path) -> bool:
    """Whether engine `name` detects `model_dir` (an exception propagates: detect must answer, not raise)."""
    return bool(default_registry().engine_class(name)().detect(model_dir))


def _options(module, model_dir: Path) -> str:
    """CONTRACT_OPTIONS of the test module for `model_dir` (a dict, or a function of the dir), as json."""
    given = getattr(module, "CONTRACT_OPTIONS", None) or {}
    return json.dumps((given(model_dir) if callable(given) else given) or {}, sort_keys=True)


def _cases(module, engines: list[str]) -> list[Case]:
    cases = []
    for d in _model_dirs(module):
        for name in engines:
            try:
                if _detects(name, d):
                    cases.append(Case(name, d, _options(module, d)))
            except Exception:  # kept out of collection; test_engine_has_a_model fails on it, naming it
                continue
    return cases


def _collected_engines(request) -> dict[str, set[str]]:
    """Model-level test name -> engines with at least one item of it in this session (after deselection)."""
    found: dict[str, set[str]] = {}
    for item in request.session.items:
        if getattr(item, "module", None) is not request.module or not hasattr(item, "callspec"):
            continue
        case = item.callspec.params.get("case")
        if isinstance(case, Case):
            found.setdefault(item.originalname, set()).add(case.engine)
    return found


def pytest_generate_tests(metafunc) -> None:
    """Parametrize `engine_name` over the engines and `case` over (engine, model dir) pairs."""
    engines = _wanted_engines(metafunc.module)
    if "engine_name" in metafunc.fixturenames:
        metafunc.parametrize("engine_name", engines)
    if "case" in metafunc.fixturenames:
        cases = _cases(metafunc.module, engines)
        metafunc.parametrize("case", cases, ids=[str(c) for c in cases])


@functools.lru_cache(maxsize=None)
def _loaded(case: Case) -> tuple[Runtime, str]:
    rt = Runtime()
    return rt, rt.load(case.model_dir, engine=case.engine, **case.load_options())


def _reference(caps: Capabilities | None = None) -> tuple[torch.Tensor, int]:
    """A voiced-sounding signal at 16 kHz (a chirp with harmonics): three seconds, or a second more than the
    shortest clip the model clones from."""
    rate = 16000
    seconds = max(3.0, (caps.min_reference_seconds + 1.0) if caps is not None else 0.0)
    t = torch.arange(int(seconds * rate), dtype=torch.float64) / rate
    f0 = 120 + 40 * torch.sin(2 * math.pi * 0.7 * t)
    phase = 2 * math.pi * torch.cumsum(f0, 0) / rate
    wave = sum(torch.sin(k * phase) / k for k in range(1, 6)) * 0.2
    return wave.float(), rate


def _request(mode: str, voices: list[Voice], caps: Capabilities | None = None, **extra) -> SynthesisRequest:
    """A valid request in `mode`, using a preset voice where the mode allows and one exists."""
    presets = [v.id for v in voices if v.kind == "preset"]
    ref = _reference(caps)
    fields = {"seed": 1234, **extra}
    if mode == "preset":
        return SynthesisRequest(TEXT, mode=mode, voice=presets[0] if presets else "missing-preset", **fields)
    if mode == "clone":
        return SynthesisRequest(TEXT, mode=mode, voice=Reference(ref, REF_TEXT), **fields)
    if mode == "cross_lingual":
        return SynthesisRequest(TEXT, mode=mode, voice=Reference(ref), **fields)
    if mode == "instruct":
        voice = presets[0] if presets else Reference(ref, REF_TEXT)
        return SynthesisRequest(TEXT, mode=mode, voice=voice, instruct="Speak slowly and calmly.", **fields)
    return SynthesisRequest(mode="vc", voice=Reference(ref, REF_TEXT), source_audio=ref, **fields)


def _check_chunks(chunks: list, caps: Capabilities, stream: bool) -> torch.Tensor:
    assert chunks, "synthesize yielded no chunks"
    for i, c in enumerate(chunks):
        assert isinstance(c, AudioChunk), f"chunk {i} is a {type(c).__name__}"
        assert c.index == i, f"chunk {i} has index {c.index}"
        assert c.final == (i == len(chunks) - 1), f"chunk {i} of {len(chunks)} has final={c.final}"
        assert c.sample_rate == caps.sample_rate
        assert torch.isfinite(c.samples).all(), f"chunk {i} has non-finite samples"
    if not stream:
        assert len(chunks) == 1, f"a non-streaming request yielded {len(chunks)} chunks"
    audio = torch.cat([c.samples.detach().cpu() for c in chunks])
    assert audio.numel() > 0, "no audio"
    return audio


# ---- engine-level ------------------------------------------------------------------------------
def test_engine_class(engine_name):
    """The engine imports, is an Engine, is named as registered and rejects directories it cannot load."""
    cls = default_registry().engine_class(engine_name)
    assert isinstance(cls, type) and issubclass(cls, Engine)
    assert cls.name == engine_name
    assert cls.capabilities is None or isinstance(cls.capabilities, Capabilities)
    engine = cls()
    assert not engine.detect(Path("/nonexistent/mizuoto-contract"))


def test_engine_ignores_empty_dir(engine_name, tmp_path):
    """An empty directory is not a model of this engine."""
    assert not default_registry().engine_class(engine_name)().detect(tmp_path)


def test_engine_has_a_model(engine_name, request):
    """The suite has at least one model directory this engine detects, and its model-level tests run.

    Counted on what runs: a conftest may deselect items after parametrization, so each model-level
    test selected in this session must still have an item for this engine. And detect() must answer
    for every offered directory: one that raises would silently drop that directory's cases.
    """
    errors = []
    for d in _model_dirs(request.module):
        try:
            _detects(engine_name, d)
        except Exception as exc:
            errors.append(f"{d}: {type(exc).__name__}: {exc}")
    assert not errors, f"{engine_name}.detect() raised (it must return a falsy value instead): " + "; ".join(errors)
    engines = _wanted_engines(request.module)
    found = [c for c in _cases(request.module, engines) if c.engine == engine_name]
    assert found, (f"no model directory for engine {engine_name!r}: list some in ${ENV_MODELS}, CONTRACT_MODELS"
                   " or the plugin's mizuoto_example_models hook")
    missing = sorted(test for test, names in _collected_engines(request).items() if engine_name not in names)
    assert not missing, (f"{engine_name!r} detects {len(found)} model dir(s), but no item of {missing} runs for it "
                         "in this session (deselected after collection?)")


# ---- model-level -------------------------------------------------------------------------------
def test_model_declares_itself(case):
    """Stages, capabilities and voices are well-formed; the planner can size every stage."""
    rt, name = _loaded(case)
    model = rt.model(name)
    stages = model.stages
    assert isinstance(stages, tuple) and stages and all(isinstance(s, Stage) for s in stages)
    assert len({s.name for s in stages}) == len(stages), "stage names repeat"
    caps = model.capabilities
    assert isinstance(caps, Capabilities)
    declared = default_registry().engine_class(case.engine).capabilities
    if declared is not None:
        assert caps.modes <= declared.modes, "a model can do no more than its engine declares"
    voices = model.voices()
    assert all(isinstance(v, Voice) for v in voices) and len({v.id for v in voices}) == len(voices)
    if "preset" in caps.modes:
        assert any(v.kind == "preset" for v in voices), "mode preset needs at least one preset voice"
    for stage in stages:
        assert stage.working_memory(None) >= 0
    plan = rt.plan(name)
    assert {s.name for s in plan.stages} == {s.name for s in stages} and plan.peak > 0


def test_synthesize_every_mode(case):
    """Each declared mode gives one final chunk of finite audio at the model's rate, with every stage
    taking turns under the scheduler; across the modes every declared stage is entered through use(),
    and every stage that declares call_memory reserves its calls through Model.room."""
    # a model of its own: the scheduler made here is its executor's placement
    options = parse_options(**case.load_options()).resolved()
    model = default_registry().engine_class(case.engine)().load(case.model_dir, options)
    caps = model.capabilities
    sizes = measure(model.stages, None, "cpu")
    turns = Plan(case.model_dir.name, "cpu", 0, False, sizes, (), run_groups(sizes, False), 0)
    reserved: list[tuple[str, int, dict]] = []

    @contextlib.contextmanager
    def room(stage, lease, working, call_sizes):
        reserved.append((stage, working, dict(call_sizes)))
        yield
    sched = Scheduler(model, "cpu", room=room)
    sched.apply(turns)
    try:
        for mode in sorted(caps.modes):
            request = check_request(_request(mode, model.voices(), model.capabilities), model)
            lease = Lease()
            with sched.hold(lease):
                _check_chunks(list(sched.execute(request, lease)), caps, stream=False)
    finally:
        sched.close()
        model.close()
    entered = {stage for stage, where in sched.trace if where == "device"}
    missing = [s.name for s in model.stages if s.name not in entered]
    assert not missing, f"stages {missing} never entered through Model.use() in any mode"
    unreserved = [s.name for s in model.stages if s.call_memory is not None and s.name not in {r[0] for r in reserved}]
    assert not unreserved, f"stages {unreserved} declare call_memory but never reserve a call through Model.room()"
    for stage, working, call_sizes in reserved:
        assert working == model.stage(stage).call_working(**call_sizes) >= 0


class _StageCalls:
    """The placement the memory check gives a model's compute loop: each stage call measured as `bench --memory`
    measures it (runtime.bench_memory.CallRecorder), a stage without `call_memory` against its working memory
    for the request."""

    def __init__(self, model, request: SynthesisRequest):
        from mizuoto.runtime.bench_memory import CallRecorder

        self.model, self.request = model, request
        self.recorder = CallRecorder(model, "cpu")

    @property
    def calls(self) -> list[dict]:
        """The calls measured so far (stage, sizes, planned, measured)."""
        return self.recorder.calls

    @contextlib.contextmanager
    def place(self, stage: str, lease: Lease | None = None):
        declared = self.model.stage(stage)
        if declared.call_memory is not None:  # measured by its reservation (reserve below)
            with self.recorder.place(stage, lease) as device:
                yield device
            return
        with self.recorder.reserve(stage, lease, declared.working_memory(self.request), {}), \
                self.recorder.place(stage, lease) as device:
            yield device

    def reserve(self, stage: str, lease: Lease | None, working: int, sizes: dict):
        return self.recorder.reserve(stage, lease, working, sizes)


def test_each_stage_call_stays_within_its_planned_memory(case):
    """Every stage call of a whole request, measured as `mizuoto bench --memory` measures it (the peak it adds to
    the process, runtime.memprobe) after a warm-up request, stays within what the runtime reserves for it: its
    `call_memory` for its sizes (a stage without one: its working memory for the request), with the heap's
    allowance every figure carries (nn.memory.HEAP_PACKING_BYTES)."""
    from mizuoto.nn.memory import HEAP_PACKING_BYTES
    from mizuoto.runtime.executor import Executor
    from mizuoto.runtime.memprobe import probe_available

    why = probe_available("cpu")
    assert why is None, f"the memory check cannot measure here: {why}"
    options = parse_options(**case.load_options()).resolved()
    model = default_registry().engine_class(case.engine)().load(case.model_dir, options)
    caps = model.capabilities
    mode = next(m for m in MODES if m in caps.modes)
    request = check_request(_request(mode, model.voices(), caps), model)
    calls = _StageCalls(model, request)
    own = model.batch_loop()
    executor = own if own is not None else Executor(f"contract-{case.model_dir.name}")
    model.executor, executor.placement = executor, calls
    try:
        list(model.synthesize(request))  # the warm-up: one-time allocations (thread pools, kernel workspaces)
        calls.calls.clear()
        _check_chunks(list(model.synthesize(request)), caps, stream=False)
    finally:
        executor.placement = None
        if own is None:
            executor.close()
            model.executor = None
        model.close()
    assert calls.calls, "the request made no stage call through Model.compute"
    wrong = [f"{c['stage']} {c['sizes']}: planned {c['planned']} B, measured {c['measured']} B" for c in calls.calls
             if c["measured"] > c["planned"] + HEAP_PACKING_BYTES]
    assert not wrong, "stage calls beyond their planned memory:\n" + "\n".join(wrong)


def test_same_seed_same_audio(case):
    """A non-streaming request with a seed is deterministic."""
    rt, name = _loaded(case)
    caps = rt.model(name).capabilities
    mode = next(m for m in MODES if m in caps.modes)
    runs = [_check_chunks(list(rt.synthesize(name, _request(mode, rt.voices(name), caps))), caps, False)
            for _ in range(2)]
    assert torch.equal(*runs)


def test_streaming(case):
    """Streaming out yields indexed chunks, the last one final; without stream_out it is refused up front."""
    rt, name = _loaded(case)
    caps = rt.model(name).capabilities
    mode = next(m for m in MODES if m in caps.modes)
    request = _request(mode, rt.voices(name), caps, stream=True)
    if not caps.stream_out:
        with pytest.raises(InvalidRequest):
            rt.synthesize(name, request)
        return
    _check_chunks(list(rt.synthesize(name, request)), caps, stream=True)


def _outcome(rt: Runtime, name: str, request: SynthesisRequest, lease: Lease | None = None) -> object:
    """A request's audio, or its error's type and message (a random test model may refuse a seed alike twice)."""
    try:
        return torch.cat([c.samples.detach().cpu() for c in rt.synthesize(name, request, lease=lease)])
    except MizuotoError as e:
        return f"{type(e).__name__}: {e}"


def _same(a: object, b: object) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) else a == b


def test_concurrent_requests_equal_each_alone(case):
    """Several seeded requests at once (threads started together) each give what they give alone."""
    import threading

    rt, name = _loaded(case)
    caps = rt.model(name).capabilities
    mode = next(m for m in MODES if m in caps.modes)
    requests = [_request(mode, rt.voices(name), caps, seed=seed) for seed in (1234, 7, 99)]
    alone = [_outcome(rt, name, r) for r in requests]
    together: list = [None] * len(requests)
    start = threading.Barrier(len(requests))

    def run(i: int) -> None:
        start.wait(10)
        together[i] = _outcome(rt, name, requests[i])
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "concurrent requests did not finish within 300 s"
    for i, (a, b) in enumerate(zip(alone, together)):
        assert _same(a, b), f"request {i} (seed {requests[i].seed}) differs when run beside the others"


def test_a_cancel_at_any_stage_ends_the_request_and_frees_the_model(case):
    """A request cancelled as it enters each stage it uses ends with RequestCancelled; once its work has ended the
    model holds nothing for it (no pin, not running), and the same seeded request then gives what it gave before."""
    from mizuoto.errors import RequestCancelled

    rt, name = _loaded(case)
    caps = rt.model(name).capabilities
    mode = next(m for m in MODES if m in caps.modes)
    request = _request(mode, rt.voices(name), caps)
    sched = rt._get(name).scheduler
    original, entered, target = sched.place, [], {}

    @contextlib.contextmanager
    def place(stage: str, lease: Lease | None = None):
        if stage not in entered:
            entered.append(stage)
        if stage == target.get("stage"):
            target["lease"].cancel("by the contract suite")
        with original(stage, lease) as device:
            yield device
    sched.place = place  # the model's Model.use reaches its scheduler's placement
    try:
        expected = _outcome(rt, name, request)
        for stage in list(entered):
            lease = Lease()
            target.update(stage=stage, lease=lease)
            with pytest.raises(RequestCancelled, match="by the contract suite"):
                list(rt.synthesize(name, request, lease=lease))
            end = time.monotonic() + 30
            while (rt.pins(name) or rt.info(name).running or not lease.released) and time.monotonic() < end:
                time.sleep(0.01)
            assert rt.pins(name) == 0 and rt.info(name).running == 0 and lease.released, \
                f"a request cancelled at its {stage} stage still holds the model 30 s later"
        target.clear()
    finally:
        del sched.place
    assert entered, "the request entered no stage through Model.use()"
    assert _same(_outcome(rt, name, request), expected), "after the cancels the same request speaks differently"


def _stream_input(model_dir: Path) -> dict | None:
    """The streamed-text input $MIZUOTO_CONTRACT_STREAM_TEXT gives this model dir, if any."""
    path = os.environ.get(ENV_STREAM_TEXT)
    if not path:
        return None
    given = json.loads(Path(path).read_text(encoding="utf-8"))
    return given.get(str(model_dir))


def test_streaming_text_in(case):
    """Text given as an iterator of pieces works when stream_in is declared and is refused otherwise.

    Every piece is read, and the audio comes as indexed chunks ending in a final one.
    """
    rt, name = _loaded(case)
    caps = rt.model(name).capabilities
    mode = next(m for m in ("clone", "preset", "cross_lingual", "instruct") if m in caps.modes) \
        if set(caps.modes) - {"vc"} else None
    if mode is None:
        return
    base = _request(mode, rt.voices(name), caps)
    given = _stream_input(case.model_dir)
    if given is not None:
        pieces, seed = list(given["pieces"]), int(given["seed"])
        voice = Reference(given["ref_audio"], given.get("ref_text"))
    else:
        pieces, seed, voice = [word + " " for word in TEXT.split()], 1, base.voice
    read: list[str] = []

    def feed():
        for piece in pieces:
            read.append(piece)
            yield piece

    request = SynthesisRequest(feed(), mode=mode, voice=voice, instruct=base.instruct, seed=seed, stream=True)
    if not caps.stream_in:
        with pytest.raises(InvalidRequest):
            rt.synthesize(name, request)
        return
    _check_chunks(list(rt.synthesize(name, request)), caps, stream=True)
    assert read == pieces, "not every streamed piece was read"


def test_bad_requests_refused_before_work(case):
    """Unknown voices and undeclared modes are clear errors raised by the call itself, not while iterating."""
    rt, name = _loaded(case)
    caps = rt.model(name).capabilities
    with pytest.raises(InvalidRequest, match="unknown voice"):
        rt.synthesize(name, TEXT, voice="no-such-voice-id")
    for mode in sorted(set(MODES) - caps.modes):
        with pytest.raises(InvalidRequest):
            rt.synthesize(name, _request(mode, rt.voices(name), caps))


def _cached_voice_request(caps: Capabilities, voice_id: str) -> SynthesisRequest:
    """A seeded request speaking with a cached voice, in the first voice mode the model has."""
    mode = next(m for m in ("clone", "cross_lingual", "instruct", "vc") if m in caps.modes)
    if mode == "vc":
        return SynthesisRequest(mode=mode, voice=voice_id, source_audio=_reference(caps), seed=1)
    extra = {"instruct": "Speak slowly."} if mode == "instruct" else {}
    return SynthesisRequest(TEXT, mode=mode, voice=voice_id, seed=1, **extra)


def test_voice_cache(case):
    """add_voice caches a prompt usable by id when voice_cache is declared; otherwise it is refused."""
    rt, name = _loaded(case)
    caps = rt.model(name).capabilities
    if not caps.voice_cache:
        with pytest.raises(MizuotoError):
            rt.add_voice(name, "contract-voice", _reference(caps), REF_TEXT)
        return
    voice = rt.add_voice(name, "contract-voice", _reference(caps), REF_TEXT)
    assert voice == Voice("contract-voice", "cached", voice.description)
    assert "contract-voice" in [v.id for v in rt.voices(name)]
    _check_chunks(list(rt.synthesize(name, _cached_voice_request(caps, "contract-voice"))), caps, stream=False)


def test_voice_export_import_remove(case):
    """A cached voice exports as tensors, is removed, and imported back speaks the same audio for the same seed."""
    rt, name = _loaded(case)
    model = rt.model(name)
    caps = model.capabilities
    if not caps.voice_cache:
        for call in (lambda: model.export_voice("x"), lambda: model.remove_voice("x"),
                     lambda: model.import_voice("x", VoicePrompt({"x": torch.zeros(1)}))):
            with pytest.raises(MizuotoError):
                call()
        return
    rt.add_voice(name, "contract-export", _reference(caps), REF_TEXT, persist=False)
    caps = model.capabilities
    before = _check_chunks(list(rt.synthesize(name, _cached_voice_request(caps, "contract-export"))), caps, False)
    prompt = model.export_voice("contract-export")
    assert isinstance(prompt, VoicePrompt) and prompt.tensors, "export_voice must give the prompt's tensors"
    model.remove_voice("contract-export")
    assert "contract-export" not in [v.id for v in model.voices()]
    with pytest.raises(InvalidRequest):
        model.remove_voice("contract-export")
    with pytest.raises(InvalidRequest):
        model.export_voice("contract-export")
    with pytest.raises(InvalidRequest, match="unknown voice"):
        rt.synthesize(name, _cached_voice_request(caps, "contract-export"))
    voice = model.import_voice("contract-export", VoicePrompt({k: t.clone() for k, t in prompt.tensors.items()},
                                                              dict(prompt.meta)))
    assert voice == Voice("contract-export", "cached", voice.description)
    assert "contract-export" in [v.id for v in model.voices()]
    caps = model.capabilities
    after = _check_chunks(list(rt.synthesize(name, _cached_voice_request(caps, "contract-export"))), caps, False)
    assert torch.equal(before, after), "an imported voice must speak as the voice it was exported from"
    model.remove_voice("contract-export")


def test_voice_survives_restart(case, tmp_path):
    """Runtime.add_voice stores the prompt; a new Runtime over the same store restores it: same audio, same seed."""
    with Runtime(voices=tmp_path) as rt:
        name = rt.load(case.model_dir, engine=case.engine, **case.load_options())
        caps = rt.model(name).capabilities
        if not caps.voice_cache:
            with pytest.raises(MizuotoError):
                rt.add_voice(name, "contract-kept", _reference(caps), REF_TEXT)
            assert not list(tmp_path.rglob("*.safetensors"))
            return
        rt.add_voice(name, "contract-kept", _reference(caps), REF_TEXT)
        caps = rt.model(name).capabilities
        before = _check_chunks(list(rt.synthesize(name, _cached_voice_request(caps, "contract-kept"))), caps, False)
    assert len(list(tmp_path.rglob("*.safetensors"))) == 1 and len(list(tmp_path.rglob("voice.json"))) == 1
    with Runtime(voices=tmp_path) as rt:
        name = rt.load(case.model_dir, engine=case.engine, **case.load_options())
        assert "contract-kept" in [v.id for v in rt.voices(name) if v.kind == "cached"]
        caps = rt.model(name).capabilities
        after = _check_chunks(list(rt.synthesize(name, _cached_voice_request(caps, "contract-kept"))), caps, False)
        assert torch.equal(before, after), "a restored voice must speak as it did before the restart"
        assert rt.remove_voice("contract-kept", name) == 2  # the loaded copy and the stored one
    assert not list(tmp_path.rglob("voice.json"))

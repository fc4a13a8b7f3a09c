"""The contract every engine meets: request/chunk/stage/capability types and the Engine and Model bases."""

from __future__ import annotations

import abc
import contextlib
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Union

import torch

from mizuoto.errors import AudioError, InvalidRequest, MemoryBudgetError
from mizuoto.runtime.executor import Executor, RoomLater  # Executor: the type of Model.executor
from mizuoto.runtime.lease import current as current_lease
from mizuoto.runtime.sequence import AloneSteps, RowSteps, Sequence
from mizuoto.runtime.request_options import RequestOption, check_declared, check_given, resolve_options  # noqa: F401 (public here)

# Synthesis modes (see docs/architecture.md):
#   preset        speak as a preset speaker the model ships (voice = preset id)
#   clone         zero-shot clone of a reference voice whose transcript is known (reference audio + text)
#   cross_lingual clone of a reference voice without using its transcript (text may be in another language)
#   instruct      speak following an instruction text (voice = preset id, reference or cached voice)
#   vc            voice conversion: re-voice `source_audio` as the reference/cached voice; no text
MODES = ("preset", "clone", "cross_lingual", "instruct", "vc")
STAGE_KINDS = ("frontend", "sequence", "frames")
SPEED_RANGE = (0.25, 4.0)

AudioSource = Union[str, os.PathLike, tuple]  # a file path, or (samples, sample_rate)


def _check_audio_source(what: str, source: Any, field: str | None = None) -> None:
    """Reject an audio source that is neither an existing file nor (1-D samples, positive rate) (`field`: its own)."""
    if isinstance(source, (str, os.PathLike)):
        if not Path(source).is_file():
            raise AudioError(f"{what}: audio file not found: {source}", field=field)
        return
    if isinstance(source, tuple) and len(source) == 2:
        samples, rate = source
        if not isinstance(rate, int) or isinstance(rate, bool) or rate <= 0:
            raise AudioError(f"{what}: sample rate must be a positive int, got {rate!r}", field=field)
        shape = tuple(getattr(samples, "shape", ()))
        if len(shape) != 1 or shape[0] == 0:
            raise AudioError(f"{what}: samples must be a non-empty 1-D array, got shape {shape}", field=field)
        return
    raise AudioError(f"{what}: expected a file path or (samples, sample_rate), got {type(source).__name__}",
                     field=field)


def load_audio(source: AudioSource) -> tuple[torch.Tensor, int]:
    """Read an audio source as (float32 mono 1-D tensor, sample rate); channels are averaged."""
    _check_audio_source("audio", source)
    if isinstance(source, tuple):
        samples, rate = source
        return torch.as_tensor(samples, dtype=torch.float32).flatten(), rate
    from mizuoto.nn.dsp.wav import read_audio, to_mono

    audio, rate = read_audio(source)
    return to_mono(audio)[0], rate


@dataclass(frozen=True)
class Reference:
    """A voice given by example: reference audio and, for clone mode, its transcript."""

    audio: AudioSource
    text: str | None = None

    def __post_init__(self) -> None:
        _check_audio_source("reference audio", self.audio, "reference")
        if self.text is not None and (not isinstance(self.text, str) or not self.text.strip()):
            raise InvalidRequest("reference text must be a non-empty string when given", field="reference")

    def load(self) -> tuple[torch.Tensor, int]:
        """The reference audio as (float32 mono samples, rate)."""
        return load_audio(self.audio)


@dataclass(frozen=True)
class Voice:
    """A voice a model can speak with by id: a preset it ships, or one cached with add_voice."""

    id: str
    kind: str  # "preset" | "cached"
    description: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise InvalidRequest("voice id must be a non-empty string")
        if self.kind not in ("preset", "cached"):
            raise InvalidRequest(f"voice kind must be 'preset' or 'cached', got {self.kind!r}")


@dataclass(frozen=True)
class VoicePrompt:
    """A cached voice as an engine exports it: named tensors, and strings the engine wants back on import."""

    tensors: dict[str, torch.Tensor]
    meta: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key, t in self.tensors.items():
            if not isinstance(key, str) or not isinstance(t, torch.Tensor):
                raise InvalidRequest(f"voice prompt entry {key!r} must be a tensor, got {type(t).__name__}")
        for key, v in self.meta.items():
            if not isinstance(key, str) or not isinstance(v, str):
                raise InvalidRequest(f"voice prompt meta {key!r} must be a string, got {type(v).__name__}")


@dataclass(frozen=True)
class Capabilities:
    """What a model (or an engine at best) can do."""

    modes: frozenset[str]
    sample_rate: int
    stream_out: bool = False
    stream_in: bool = False
    languages: tuple[str, ...] = ()
    voice_cache: bool = False  # the model implements add_voice
    options: tuple[RequestOption, ...] = ()  # engine-specific request settings (runtime.request_options)
    min_reference_seconds: float = 0.0  # the shortest reference clip the model clones from (longer: AudioError)

    def __post_init__(self) -> None:
        object.__setattr__(self, "modes", frozenset(self.modes))
        object.__setattr__(self, "options", check_declared(self.options))
        object.__setattr__(self, "languages", tuple(self.languages))
        if not self.modes:
            raise InvalidRequest("capabilities: at least one mode is required")
        unknown = sorted(self.modes - set(MODES))
        if unknown:
            raise InvalidRequest(f"capabilities: unknown modes {unknown}; known: {', '.join(MODES)}")
        if not isinstance(self.sample_rate, int) or self.sample_rate <= 0:
            raise InvalidRequest(f"capabilities: sample_rate must be a positive int, got {self.sample_rate!r}")


@dataclass(frozen=True)
class SynthesisRequest:
    """One synthesis call. `mode=None` means: inferred by the runtime from the other fields (see resolve_mode)."""

    text: str | Iterable[str] | None = None
    mode: str | None = None
    voice: str | Reference | None = None  # preset id / cached voice id, or a Reference
    instruct: str | None = None
    source_audio: AudioSource | None = None  # vc mode only
    speed: float = 1.0
    stream: bool = False
    seed: int | None = None
    # engine-specific settings by name (Capabilities.options); check_request fills in every default
    options: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", check_given(self.options))
        if self.mode is not None and self.mode not in MODES:
            raise InvalidRequest(f"unknown mode {self.mode!r}; known: {', '.join(MODES)}", field="mode")
        if isinstance(self.text, str):
            if not self.text.strip():
                raise InvalidRequest("text is empty", field="text")
        elif self.text is not None and (isinstance(self.text, (bytes, bytearray)) or not isinstance(self.text, Iterable)):
            raise InvalidRequest(f"text must be a string or an iterable of strings, got {type(self.text).__name__}",
                                 field="text")
        if isinstance(self.voice, str) and not self.voice:
            raise InvalidRequest("voice id is empty", field="voice")
        if self.voice is not None and not isinstance(self.voice, (str, Reference)):
            raise InvalidRequest(f"voice must be a voice id or a Reference, got {type(self.voice).__name__}",
                                 field="voice")
        if self.instruct is not None and (not isinstance(self.instruct, str) or not self.instruct.strip()):
            raise InvalidRequest("instruct text is empty", field="instruct")
        if self.source_audio is not None:
            _check_audio_source("source audio", self.source_audio, "source_audio")
        if isinstance(self.speed, bool) or not isinstance(self.speed, (int, float)) or not math.isfinite(self.speed) \
                or not SPEED_RANGE[0] <= self.speed <= SPEED_RANGE[1]:
            raise InvalidRequest(f"speed must be a number in [{SPEED_RANGE[0]}, {SPEED_RANGE[1]}], got {self.speed!r}",
                                 field="speed")
        if not isinstance(self.stream, bool):
            raise InvalidRequest(f"stream must be True or False, got {self.stream!r}", field="stream")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise InvalidRequest(f"seed must be a non-negative int, got {self.seed!r}", field="seed")
        if self.mode is not None:
            _check_mode_fields(self)

    @property
    def text_streamed(self) -> bool:
        """True when text arrives as an iterator of pieces (streaming text in)."""
        return self.text is not None and not isinstance(self.text, str)


def _check_mode_fields(r: SynthesisRequest) -> None:
    """The fields each mode needs, and those it forbids."""
    if r.mode == "vc":
        if r.source_audio is None:
            raise InvalidRequest("mode 'vc' needs source_audio", field="source_audio")
        if r.text is not None:
            raise InvalidRequest("mode 'vc' takes no text", field="text")
    else:
        if r.text is None:
            raise InvalidRequest(f"mode {r.mode!r} needs text", field="text")
        if r.source_audio is not None:
            raise InvalidRequest(f"source_audio is only for mode 'vc', not {r.mode!r}", field="source_audio")
    if r.mode == "instruct" and r.instruct is None:
        raise InvalidRequest("mode 'instruct' needs instruct text", field="instruct")
    if r.mode != "instruct" and r.instruct is not None:
        raise InvalidRequest(f"instruct text is only for mode 'instruct', not {r.mode!r}", field="instruct")
    if r.voice is None:
        raise InvalidRequest(f"mode {r.mode!r} needs a voice", field="voice")
    if r.mode == "preset" and not isinstance(r.voice, str):
        raise InvalidRequest("mode 'preset' needs a preset voice id, not reference audio", field="voice")
    if r.mode == "clone" and isinstance(r.voice, Reference) and r.voice.text is None:
        raise InvalidRequest("mode 'clone' needs the reference text (use mode 'cross_lingual' without it)",
                             field="reference")


def resolve_mode(request: SynthesisRequest, voices: Iterable[Voice]) -> SynthesisRequest:
    """Fill in an omitted mode from the fields and the model's voices; check the voice id is known."""
    known = {v.id: v for v in voices}
    if isinstance(request.voice, str) and request.voice not in known:
        listed = ", ".join(sorted(known)) or "none"
        raise InvalidRequest(f"unknown voice {request.voice!r}; this model has: {listed}", field="voice")
    if request.mode is not None:
        return request
    if request.source_audio is not None:
        mode = "vc"
    elif request.instruct is not None:
        mode = "instruct"
    elif isinstance(request.voice, Reference):
        mode = "clone" if request.voice.text is not None else "cross_lingual"
    elif isinstance(request.voice, str):
        mode = "preset" if known[request.voice].kind == "preset" else "clone"
    else:
        raise InvalidRequest("no voice given: pass a preset voice id, a cached voice id or reference audio",
                         field="voice")
    return replace(request, mode=mode)


def check_request(request: SynthesisRequest, model: Model, name: str = "model") -> SynthesisRequest:
    """Resolve the mode and check the request against the model's capabilities, before any work."""
    caps = model.capabilities
    request = resolve_mode(request, model.voices())
    if request.mode not in caps.modes:
        raise InvalidRequest(f"{name} does not support mode {request.mode!r}; it supports: {', '.join(sorted(caps.modes))}",
                             field="mode")
    if request.stream and not caps.stream_out:
        raise InvalidRequest(f"{name} cannot stream audio out", field="stream")
    if request.text_streamed and not caps.stream_in:
        raise InvalidRequest(f"{name} cannot take streamed text in; pass the text as one string", field="text")
    return replace(request, options=resolve_options(caps.options, request.options, name))


@dataclass(frozen=True)
class AudioChunk:
    """A piece of output audio; a non-streaming request yields exactly one, with final=True."""

    samples: torch.Tensor
    sample_rate: int
    index: int
    final: bool

    def __post_init__(self) -> None:
        s = self.samples
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or s.dim() != 1:
            got = f"{s.dtype} {tuple(s.shape)}" if isinstance(s, torch.Tensor) else type(s).__name__
            raise InvalidRequest(f"audio chunk samples must be a float32 1-D tensor, got {got}")
        if not isinstance(self.sample_rate, int) or self.sample_rate <= 0:
            raise InvalidRequest(f"audio chunk sample_rate must be a positive int, got {self.sample_rate!r}")
        if not isinstance(self.index, int) or self.index < 0:
            raise InvalidRequest(f"audio chunk index must be a non-negative int, got {self.index!r}")


@dataclass(frozen=True)
class Stage:
    """A part of a model that runs as a unit and moves between devices as a unit.

    `working_memory(request)` gives the bytes a request is admitted with for the stage, beside its
    weights; with `request=None` it must give the figure the planner uses for any request. A stage
    that also declares `call_memory` reserves each call's own working memory when its inputs are
    known (`Model.room(stage, lease, **sizes)`: `call_memory(**sizes)` bytes, for the block); its
    `memory` then gives the least any request needs of it (what every request certainly uses),
    not a bound. `fixed` names modules that never move device (whoever uses them reads their device).
    """

    name: str
    kind: str
    modules: Mapping[str, torch.nn.Module]
    fixed: frozenset[str] = frozenset()
    memory: Callable[[SynthesisRequest | None], int] = field(default=lambda request: 0, compare=False)
    call_memory: Callable[..., int] | None = field(default=None, compare=False)
    # the most one call of this stage may need for a request (None: its `memory`); a batched model's
    # rows join only while every row's largest call fits beside the others' reserves
    bound_memory: Callable[[SynthesisRequest | None], int] | None = field(default=None, compare=False)
    # a sequence stage's decoder, head and sampler (runtime.sequence.Sequence): the runtime runs its token
    # loop (`Model.decode`), alone or in the model's continuous batch
    sequence: Sequence | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "fixed", frozenset(self.fixed))
        if self.sequence is not None and self.kind != "sequence":
            raise InvalidRequest(f"stage {self.name!r}: only a sequence stage declares a Sequence")
        if not isinstance(self.name, str) or not self.name:
            raise InvalidRequest("stage name must be a non-empty string")
        if self.kind not in STAGE_KINDS:
            raise InvalidRequest(f"stage {self.name!r}: kind must be one of {', '.join(STAGE_KINDS)}, got {self.kind!r}")
        for key, module in self.modules.items():
            if not isinstance(module, torch.nn.Module):
                raise InvalidRequest(f"stage {self.name!r}: module {key!r} is a {type(module).__name__}, not a torch Module")
        stray = sorted(self.fixed - set(self.modules))
        if stray:
            raise InvalidRequest(f"stage {self.name!r}: fixed modules {stray} are not among its modules")

    def working_memory(self, request: SynthesisRequest | None) -> int:
        """Bytes of working memory for `request` (None: the planning bound)."""
        n = self.memory(request)
        if not isinstance(n, int) or n < 0:
            raise InvalidRequest(f"stage {self.name!r}: working memory must be a non-negative int, got {n!r}")
        return n

    def call_working(self, **sizes: int) -> int:
        """Bytes of working memory one call on inputs of these sizes needs (its `call_memory`)."""
        if self.call_memory is None:
            raise InvalidRequest(f"stage {self.name!r} declares no per-call working memory")
        n = self.call_memory(**sizes)
        if not isinstance(n, int) or n < 0:
            raise InvalidRequest(f"stage {self.name!r}: a call's working memory must be a non-negative int, got {n!r}")
        return n

    def movable(self) -> dict[str, torch.nn.Module]:
        """The modules the scheduler may move."""
        return {k: m for k, m in self.modules.items() if k not in self.fixed}


class Model(abc.ABC):
    """A loaded model. Engines subclass it; the runtime drives it only through these members.

    Engines compute; the runtime runs (engine contract v2). An engine's request code states each
    piece of heavy work as `self.compute(stage, fn, **sizes)`: the runtime reserves the call's
    working memory for its sizes, runs fn on the model's one compute thread with the stage's
    modules placed, and bounds every wait by the request's lease. A sequence stage's token loop is
    run by `self.decode(stage, loop)`, alone or in the model's continuous batch (runtime.sequence).
    Engine code never passes a lease nor picks a thread (the runtime sets the request's context,
    `runtime.lease.current`). An engine sets `stages` and `capabilities` when it loads (attributes,
    or properties of its own). `use`, `room` and `submit` are the runtime's mechanics under
    `compute` and `decode`, not for engines.
    """

    stages: tuple[Stage, ...]  # the model's stages in the order a request runs through them
    capabilities: Capabilities  # what this model can do (may change, e.g. when a voice is added)
    # Requests the model runs at once: above 1 its sequence stage (one that declares a `Sequence`) batches
    # them (runtime.batching) and its stage calls take turns (one `use` block at a time).
    batch_width: int = 1
    # The model's one compute thread (`Executor`): every stage call of its requests runs there, and
    # the runtime's placement of its modules is a property of it (`Executor.placement`). The runtime
    # gives it one when it adopts the model: its continuous batch when it batches (`batch_loop`), a
    # plain Executor else. At width 1 the runtime runs each step of the `synthesize` iterator there,
    # one request at a time; above it, each request's iterator runs in its own thread and its compute
    # goes there (so requests interleave there, and one waiting for streamed text holds no turn).
    executor: Executor | None = None
    _batch: Executor | None = None  # the continuous batch, once made (batch_loop)

    def voices(self) -> list[Voice]:
        """Preset and cached voices."""
        return []

    @abc.abstractmethod
    def synthesize(self, request: SynthesisRequest) -> Iterator[AudioChunk]:
        """Yield audio chunks for a request whose mode is resolved and checked against capabilities.

        The runtime runs each step of the iterator as the request: `use`, `room`, `submit` and a
        batched LM's rows read its lease from there (`runtime.lease.current`), so none is passed.
        """

    def add_voice(self, voice_id: str, ref_audio: AudioSource, ref_text: str | None = None) -> Voice:
        """Cache a voice prompt under `voice_id` (only when capabilities.voice_cache)."""
        raise InvalidRequest(f"{type(self).__name__} cannot cache voices")

    def export_voice(self, voice_id: str) -> VoicePrompt:
        """A cached voice's prompt as tensors (+ strings), to be stored and imported later (voice_cache only)."""
        raise InvalidRequest(f"{type(self).__name__} cannot export cached voices")

    def import_voice(self, voice_id: str, prompt: VoicePrompt) -> Voice:
        """Cache a prompt that `export_voice` gave, without running the front end (voice_cache only)."""
        raise InvalidRequest(f"{type(self).__name__} cannot import cached voices")

    def remove_voice(self, voice_id: str) -> None:
        """Forget a cached voice (voice_cache only); an unknown id is an InvalidRequest."""
        raise InvalidRequest(f"{type(self).__name__} cannot remove cached voices")

    def close(self) -> None:
        """Release what the model holds; it is not used afterwards (an override calls this too)."""
        batch, self._batch = self._batch, None
        if batch is not None:
            batch.close()  # answers what still waits and joins its loop
            if self.executor is batch:
                self.executor = None

    # -- what engines compute with ------------------------------------------------------------
    def compute(self, stage: str | None, fn: Callable[[torch.device | None], Any], *, kind: str | None = None,
                urgent: bool = False, reserve: Mapping[str, Mapping[str, int]] | None = None, **sizes: int) -> Any:
        """fn(device) on the model's compute thread with `stage`'s modules placed on `device`; fn's result.

        `sizes`: the call's input sizes when the stage declares `call_memory` (its working memory is
        reserved for the call first, on the compute thread: a batch loop, which never waits, puts a
        call whose room others hold aside until memory is let go; a model running one request at a
        time waits there like admission); `reserve`: other stages' calls fn makes inside (nested
        `compute`s), reserved with this one (stage -> sizes, at most what they will be).
        `stage=None`: fn places nothing itself (each nested `compute` does), device None. `kind`
        names the work in the loop's timings (default: the stage); `urgent`: a request's first
        audio, which a batch loop runs ahead of its other work. The request's cancel or deadline
        ends every wait here (RequestCancelled).
        """
        # `reserve` is for a call sent to a batch loop, whose nested computes must find their room made: a model
        # running one request at a time reserves each nested compute's own, as it comes
        batched = self.batch_width > 1 and not (self.executor is not None and self.executor.on_thread())
        rooms = dict(reserve or {}) if batched else {}
        if stage is not None and sizes:
            rooms = {stage: sizes, **rooms}

        def run() -> Any:
            with contextlib.ExitStack() as stack:
                for name, call_sizes in rooms.items():  # RoomLater here: nothing ran, the loop may run it again
                    stack.enter_context(self.room(name, **call_sizes))
                try:
                    if stage is None:
                        return fn(None)
                    with self.use(stage) as device:
                        return fn(device)
                except RoomLater as e:
                    # a nested call's room, asked for after work of this call ran: running the call again would
                    # repeat that work (its draws, its caches), so it gives way (declare it in `reserve=`)
                    raise MemoryBudgetError(f"a call inside the {stage or kind or 'compute'} call could not get its "
                                            f"room ({e}); declare it in reserve= so that it is reserved before the "
                                            "call starts") from None
        return self.submit(run, kind=kind or stage or "call", urgent=urgent)

    def decode(self, stage: str, loop: Callable[[Any], Iterator[int]], *, alone: bool = False,
               **sizes: int) -> Iterator[int]:
        """The tokens of the engine's token loop `loop(steps)` on `stage`'s sequence (runtime.sequence).

        The model's continuous batch runs it when the model batches (unless `alone`: the request by
        itself on this thread, a benchmark's single-request figures), else it runs alone here with
        one stage call per token. `sizes`: the whole generation's call sizes (`call_memory`),
        reserved while the tokens are read (in a batch, by the batch loop as the sequence starts:
        one whose room others hold waits aside there, its rows kept, until memory is let go).
        """
        spec = self.stage(stage).sequence
        batch = None if alone else self.batch_loop()
        if batch is not None and spec is not None:
            def produce(rows: Any) -> Iterator[Any]:
                return loop(RowSteps(rows if isinstance(rows, tuple) else (rows,), spec))

            def reserved(rows: Any) -> Iterator[Any]:
                # on the batch loop, at the sequence's first resume: a room others hold puts it aside (RoomLater)
                with self.room(stage, **sizes):
                    return (yield from produce(rows))
            yield from batch.run(reserved if sizes else produce, rows=spec.rows)
            return
        with self.room(stage, **sizes) if sizes else contextlib.nullcontext():
            tokens = iter(loop(AloneSteps(spec)))
            try:
                while True:
                    # per token: in a streaming request the flow and vocoder run between two tokens
                    with self.use(stage) as device, (spec.context(device) if spec is not None and spec.context
                                                     else contextlib.nullcontext()):
                        token = next(tokens, None)
                    if token is None:
                        return
                    yield token
            finally:
                close = getattr(tokens, "close", None)
                if close is not None:
                    close()

    def batch_loop(self) -> Executor | None:
        """The model's continuous batch (runtime.batching), made on the first call when `batch_width` > 1 and a
        sequence stage declares a `Sequence` with a decoder (its layers packed then, at load, if it allows);
        it is then the model's executor. None for a model that runs one request at a time."""
        if self._batch is not None or self.batch_width <= 1:
            return self._batch
        found = next(((s.name, s.sequence) for s in self.stages if s.sequence is not None and s.sequence.batches),
                     None)
        if found is None:
            return None
        from mizuoto.runtime.batching import DecodeBatcher  # the batch's machinery only for a model that batches

        name, spec = found
        self._batch = DecodeBatcher(spec.decoder, spec.row_head or spec.head, self.batch_width * spec.rows,
                                    lambda: self.use(name), spec.sampler, name=f"{name}-{type(self).__name__}",
                                    pack=spec.pack, cuda_graphs=spec.cuda_graphs)
        self.executor = self._batch
        return self._batch

    # -- the runtime's mechanics under compute and decode (engines never call them: tests/test_engine_api.py) ------
    def submit(self, fn: Callable[[], Any], lease: Any = None, kind: str = "call", *, urgent: bool = False) -> Any:
        """fn() on the model's executor with the request's lease (at once when already there, or with no executor).

        `kind` names the work in the executor's timings; `urgent`: a request's first audio, which a
        batch loop runs ahead of its other work (`Executor.call`).
        """
        lease = lease if lease is not None else current_lease()
        return fn() if self.executor is None else self.executor.call(fn, lease, kind, urgent=urgent)

    @contextlib.contextmanager
    def room(self, stage: str, lease: Any = None, **sizes: int) -> Iterator[int]:
        """Memory for one call of `stage` on inputs of these sizes, reserved for `lease` during the block.

        Yields the call's working memory (`Stage.call_working`). Under a runtime, the request's
        reservation grows to it first, evicting idle models or waiting for room like admission
        (RequestTooLarge when the budget can never hold it); without one, nothing is reserved.
        `compute` enters it on the model's compute loop as the call starts; a batch loop never waits:
        there a room others hold raises `RoomLater` and the loop puts the call aside until memory is
        let go. Without a `lease`, the lease of the request whose code runs (`runtime.lease.current`).
        """
        working = self.stage(stage).call_working(**sizes)
        lease = lease if lease is not None else current_lease()
        placement = self._placement()
        if placement is None:
            yield working
            return
        with placement.reserve(stage, lease, working, sizes):
            yield working

    @contextlib.contextmanager
    def use(self, stage: str, lease: Any = None) -> Iterator[torch.device]:
        """Run the block with `stage`'s modules placed as planned; yields the device they are on.

        `lease` (a `runtime.lease.Lease`): the request the call is for; its cancel or deadline
        raises RequestCancelled here, before the stage runs. Without one, the lease of the
        request whose code runs (`runtime.lease.current`), if any.
        """
        lease = lease if lease is not None else current_lease()
        if lease is not None:
            lease.check(f"before its {stage} stage call")
        placement = self._placement()
        if placement is None:
            yield stage_device(self.stage(stage))
            return
        with placement.place(stage, lease) as device:
            yield device

    def _placement(self) -> Any:
        return self.executor.placement if self.executor is not None else None

    def stage(self, name: str) -> Stage:
        """The stage called `name`."""
        for s in self.stages:
            if s.name == name:
                return s
        raise InvalidRequest(f"{type(self).__name__} has no stage {name!r}")


def stage_device(stage: Stage) -> torch.device:
    """Where the stage's movable modules are (the first tensor found), else the CPU."""
    for module in stage.movable().values():
        for t in module.parameters():
            return t.device
        for t in module.buffers():
            return t.device
    return torch.device("cpu")


class Engine(abc.ABC):
    """An engine: recognises model directories and loads them. Instantiated with no arguments."""

    name: str = ""
    description: str = ""
    capabilities: Capabilities | None = None  # the most a model of this engine can do, for listings

    @abc.abstractmethod
    def detect(self, model_dir: Path) -> bool | str:
        """Falsy if this engine cannot load `model_dir`; True or a variant name if it can. Cheap; never raises."""

    @abc.abstractmethod
    def load(self, model_dir: Path, options: Any) -> Model:
        """Build the model from `model_dir` with LoadOptions; modules on the host, fixed ones where they live."""

    @classmethod
    def model_name(cls, model_dir: Path) -> str:
        """The name a model of `model_dir` gets when none is given, and the short id `-m` takes for a directory
        a plugin offers (mizuoto_example_models); default: the folder's name. Cheap; never raises."""
        return Path(model_dir).resolve().name

    # -- benchmarks (optional) -----------------------------------------------------------------
    bench_random: tuple[str, ...] = ()  # model kinds `mizuoto bench --random KIND` can build with random weights

    def bench_driver(self, model_dir: Path | None, random: str | None, options: Any, settings: Any,
                     workdir: Path, assets: str | Path | None = None) -> Any:
        """A `mizuoto.runtime.bench.BenchDriver` over this engine's own model, or None when not offered.

        Calling convention: `mizuoto bench` calls it with a detected `model_dir` (random None) or
        with one of `bench_random` (model_dir None), resolved LoadOptions, BenchSettings, a work
        folder for random models and the `--assets` folder if given. The driver must time the
        functions a request runs (the loaded model's own stages), not a copy of them.
        """
        return None

    @classmethod
    def offers_bench(cls) -> bool:
        """Whether this engine overrides `bench_driver`."""
        return cls.bench_driver is not Engine.bench_driver

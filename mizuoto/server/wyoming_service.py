"""What every Wyoming connection shares (`WyomingService`): the voices offered, the describe answer, how a request
names its voice, and the checked request fields with the server's seed and --param options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from wyoming.info import Attribution, Info, TtsProgram, TtsVoice
from wyoming.tts import SynthesizeVoice

from mizuoto import __version__
from mizuoto.errors import InvalidRequest, MizuotoError
from mizuoto.runtime.request_options import parse_settings
from mizuoto.server.errors import ApiError
from mizuoto.server.schemas import check_text, checked
from mizuoto.server.state import ServerState

_ATTRIBUTION = Attribution(name="Mizuoto", url="")
_CLONES = frozenset({"clone", "cross_lingual"})  # modes that speak a clip (instruct alone may take presets only)


@dataclass(frozen=True)
class VoiceEntry:
    """One voice offered over Wyoming: `model/voice`, spoken by a served model."""

    name: str
    model: str
    voice: str
    engine: str
    languages: tuple[str, ...]

    def wyoming(self) -> TtsVoice:
        """The voice as the info event lists it."""
        return TtsVoice(name=self.name, attribution=_ATTRIBUTION, installed=True, version=None,
                        description=f"{self.voice} ({self.engine} engine, model {self.model})",
                        languages=list(self.languages))


class WyomingService:
    """What every connection shares: the server state, and the seed and engine options given to each request."""

    def __init__(self, state: ServerState, seed: int | None = None, params: tuple[str, ...] = ()):
        self.state = state
        self.seed = seed
        # `NAME=VALUE` request options (Home Assistant sends none): each request gets those its engine declares
        self.settings = tuple(params)
        engines = state.runtime.engines() if hasattr(state.runtime, "engines") else {}
        declared = {name: cls.capabilities.options for name, cls in engines.items() if cls.capabilities is not None}
        for param in self.settings:  # each value checked now against every engine declaring its name
            name = param.partition("=")[0].strip()
            takers = [(engine, options) for engine, options in declared.items() if name in {o.name for o in options}]
            if not takers:
                known = sorted({o.name for options in declared.values() for o in options})
                raise InvalidRequest(f"--param {param}: no installed engine declares {name!r}; "
                                     f"declared: {', '.join(known) or 'none'}")
            for engine, options in takers:
                parse_settings(options, [param], f"engine {engine}")
        self._known: dict[str, list[VoiceEntry]] = {}  # last seen voices of each model, kept while it is evicted

    def load_all(self) -> None:
        """Load every catalogue model (at start, so the first request does not wait)."""
        for name in list(self.state.catalogue):
            self.state.ensure_loaded(name)

    def voices(self) -> list[VoiceEntry]:
        """Every served model's voices: its presets (if it speaks them alone), then the uploaded voices if it clones."""
        state = self.state
        for model in state.loaded():
            try:
                info, caps = state.runtime.info(model), state.runtime.model(model).capabilities
                # a request names a voice and nothing more: a preset that speaks only with an instruction (Qwen3-TTS
                # VoiceDesign's) would fail every time
                ids = [v.id for v in state.runtime.voices(model) if v.kind != "preset" or "preset" in caps.modes]
            except MizuotoError:  # evicted or unloaded meanwhile: keep what was last seen
                continue
            if caps.modes & _CLONES:
                ids += [v for v in state.voices if v not in ids]
            self._known[model] = [VoiceEntry(f"{model}/{v}", model, v, info.engine, caps.languages) for v in ids]
        return [v for model in state.catalogue for v in self._known.get(model, [])] + \
               [v for model, entries in self._known.items() if model not in state.catalogue for v in entries]

    def info(self) -> Info:
        """The answer to describe."""
        program = TtsProgram(name="mizuoto", attribution=_ATTRIBUTION, installed=True, version=__version__,
                             description="Mizuoto speech runtime", voices=[v.wyoming() for v in self.voices()],
                             supports_synthesize_streaming=True)
        return Info(tts=[program])

    def resolve(self, wanted: SynthesizeVoice | None) -> VoiceEntry:
        """The voice a request names: `model/voice`, a model (with an optional speaker), a language, or the default."""
        voices = self.voices()
        if not voices:
            raise ApiError(400, "no voice is served: models without preset voices need --voice ID=CLIP")
        if wanted is None or (wanted.name is None and wanted.language is None):
            return voices[0]
        if wanted.name is not None:
            name = wanted.name if wanted.speaker is None or "/" in wanted.name else f"{wanted.name}/{wanted.speaker}"
            for v in voices:
                if v.name == name or (v.model == name and "/" not in name):
                    return v
            raise ApiError(400, f"unknown voice {name!r}; served voices: {', '.join(v.name for v in voices)}")
        for v in voices:
            if any(_base(x) == _base(wanted.language) for x in v.languages):
                return v
        raise ApiError(400, f"no served voice speaks language {wanted.language!r}")

    def params(self, voice: VoiceEntry) -> Any:
        """Checked request fields for a voice (the text goes separately)."""
        data: dict[str, Any] = {"model": voice.model, "voice": voice.voice}
        if self.seed is not None:
            data["seed"] = self.seed
        if self.settings:
            data["options"] = self.options(voice)
        return checked(self.state.session, data)

    def options(self, voice: VoiceEntry) -> dict[str, Any]:
        """The --param options the voice's engine declares, parsed by their declared types."""
        cls = self.state.runtime.engines().get(voice.engine)
        declared = cls.capabilities.options if cls is not None and cls.capabilities is not None else ()
        names = {o.name for o in declared}
        return parse_settings(declared, [p for p in self.settings if p.partition("=")[0].strip() in names],
                              f"engine {voice.engine}")

    def check_text(self, text: Any, so_far: int = 0) -> str:
        """The text of a request or chunk, refused when it is not a string or past the length limit."""
        if not isinstance(text, str):
            raise ApiError(400, f"text must be a string, got {type(text).__name__}")
        check_text(text, "text", self.state.config.max_input_chars, so_far)  # as HTTP refuses it
        return text

    def max_event_bytes(self) -> int:
        """The most data (or payload) bytes one event may declare: the longest text at 12 bytes a character
        (a JSON-escaped surrogate pair) with 64 KiB for the other fields, and never more than an HTTP body."""
        config = self.state.config
        return min(config.max_body_bytes, 12 * config.max_input_chars + (64 << 10))


def _base(language: str) -> str:
    """`en` for en, en_US, en-GB: Home Assistant and the engines name languages differently."""
    return language.lower().replace("-", "_").split("_")[0]

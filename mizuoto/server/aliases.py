"""Model and voice aliases given on the command line: `--alias tts-1=cosy`, `--voice-alias alloy=piper/joe`.

OpenAI's clients and integrations name OpenAI's models and voices (`tts-1`, `alloy`); an alias lets
them reach a served model and one of its voices unchanged. A model alias stands for a served model
wherever a request names a model; a voice alias stands for a voice of one model (`alloy=piper/joe`)
or of every model (`alloy=joe`) wherever a request names a voice, and wins over a voice of that id.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from mizuoto.errors import InvalidRequest
from mizuoto.runtime.voicestore import VOICE_ID
from mizuoto.server.schemas import NAME


@dataclass(frozen=True)
class Aliases:
    """Model aliases (alias -> served model) and voice aliases ((model, or None for every model, alias) -> voice)."""

    models: dict[str, str] = field(default_factory=dict)
    voices: dict[tuple[str | None, str], str] = field(default_factory=dict)

    @classmethod
    def parse(cls, model_specs: Iterable[str], voice_specs: Iterable[str], served: Iterable[str]) -> Aliases:
        """Aliases from `ALIAS=MODEL` and `ALIAS=[MODEL/]VOICE` specs, each checked against the `served` names."""
        served = set(served)
        models: dict[str, str] = {}
        for spec in model_specs:
            alias, _, target = spec.partition("=")
            if not NAME.fullmatch(alias) or not target:
                raise InvalidRequest(f"--alias {spec}: use ALIAS=MODEL, the alias 1-128 letters, digits or"
                                     " '_', '.', ':', '/', '-'")
            if alias in served:
                raise InvalidRequest(f"--alias {spec}: {alias!r} is a served model's name")
            if target not in served:
                raise InvalidRequest(f"--alias {spec}: no served model is named {target!r}"
                                     f" (served: {', '.join(sorted(served)) or 'none'})")
            if models.setdefault(alias, target) != target:
                raise InvalidRequest(f"--alias {spec}: {alias!r} already stands for {models[alias]!r}")
        voices: dict[tuple[str | None, str], str] = {}
        for spec in voice_specs:
            alias, _, target = spec.partition("=")
            model, slash, voice = target.rpartition("/")  # a voice id has no '/'; a model name may (org/name)
            if not VOICE_ID.fullmatch(alias) or not VOICE_ID.fullmatch(voice) or (slash and not model):
                raise InvalidRequest(f"--voice-alias {spec}: use ALIAS=VOICE (on every model) or ALIAS=MODEL/VOICE,"
                                     " the alias and voice 1-64 letters, digits, '_', '.' or '-'")
            key = (models.get(model, model) if slash else None, alias)
            if key[0] is not None and key[0] not in served:
                raise InvalidRequest(f"--voice-alias {spec}: no served model is named {model!r}")
            if voices.setdefault(key, voice) != voice:
                raise InvalidRequest(f"--voice-alias {spec}: {alias!r} already stands for {voices[key]!r}"
                                     f"{f' on {key[0]}' if key[0] else ''}")
        return cls(models, voices)

    def model(self, name: str | None) -> str | None:
        """The served model `name` stands for (itself unless it is an alias)."""
        return self.models.get(name, name) if name is not None else None

    def voice(self, model: str, voice: str | None) -> str | None:
        """The voice `voice` stands for on the served `model` (itself unless it is an alias there)."""
        if voice is None:
            return None
        return self.voices.get((model, voice), self.voices.get((None, voice), voice))

    def apply(self, p: Any) -> Any:
        """A checked speech body (or session.start) with its model and voice aliases replaced by what they stand for."""
        if not self.models and not self.voices:
            return p
        model = self.model(p.model)
        return p.model_copy(update={"model": model, "voice": self.voice(model, p.voice)})

    def of_model(self, name: str) -> list[str]:
        """The model aliases that stand for `name`."""
        return sorted(a for a, t in self.models.items() if t == name)

    def voices_of(self, name: str) -> dict[str, str]:
        """The voice aliases in force on model `name` (alias -> voice): every model's, then its own."""
        out = {a: v for (m, a), v in self.voices.items() if m is None}
        out.update({a: v for (m, a), v in self.voices.items() if m == name})
        return dict(sorted(out.items()))

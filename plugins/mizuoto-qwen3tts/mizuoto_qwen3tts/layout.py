"""What a Qwen3-TTS model directory is, read from its files without loading weights (detect and load).

A directory in upstream's released layout holds `config.json` (a `Qwen3TTSConfig`: `model_type`
"qwen3_tts", its `tts_model_type` base / custom_voice / voice_design), `generation_config.json`, the
weights, the text tokenizer (vocab.json, merges.txt) and the 12 Hz codec under `speech_tokenizer/`.
Speakers and languages are the config's (`ids.ModelIds`: upstream's `get_supported_speakers` /
`_languages`, every `codec_language_id` but the dialects, and "auto").
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from mizuoto.errors import ModelLoadError
from mizuoto_qwen3tts.ids import AUTO, ModelIds

KINDS = ("base", "custom_voice", "voice_design")
TOKENIZER_12HZ = "qwen3_tts_tokenizer_12hz"
# upstream drops a CustomVoice instruction when `tts_model_size in "0b6"` (a substring test, so "0b6", "0b", "b6",
# "0" and "" all drop it): such a model takes no instruction, and Mizuoto refuses one rather than drop it
NO_INSTRUCT_SIZES = "0b6"
# the capability lists languages as codes, as every engine does (listings, Wyoming's match of a client's "en");
# requests name them as upstream does (the `language` option); a name not here is listed as it is
ISO_639_1 = {"chinese": "zh", "english": "en", "german": "de", "italian": "it", "portuguese": "pt", "spanish": "es",
             "japanese": "ja", "korean": "ko", "french": "fr", "russian": "ru"}


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{path} is missing") from None
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path} is unreadable: {exc}") from None


@dataclass(frozen=True)
class ModelLayout:
    """A model directory's kind, sizes, speakers and languages, and where its parts are."""

    model_dir: Path
    config: dict
    generation: dict
    kind: str
    size: str
    hidden: int
    groups: int
    ids: ModelIds
    speakers: dict[str, str | None] = field(default_factory=dict)  # name -> its dialect (a language id's name)
    languages: tuple[str, ...] = ()  # upstream's names, "auto" first

    @property
    def codec_dir(self) -> Path:
        """The 12 Hz codec's directory."""
        return self.model_dir / "speech_tokenizer"

    @property
    def instruct(self) -> bool:
        """Whether the model takes an instruction (VoiceDesign always; CustomVoice unless upstream drops it)."""
        return self.kind == "voice_design" or (self.kind == "custom_voice" and self.size not in NO_INSTRUCT_SIZES)

    @property
    def language_codes(self) -> tuple[str, ...]:
        """The languages a request may name (its `language` option) as the model's capability: ISO 639-1 codes."""
        return tuple(ISO_639_1.get(x, x) for x in self.languages if x != AUTO)


def read_layout(model_dir: Path) -> ModelLayout:
    """The layout of `model_dir`; ModelLoadError when it is not a Qwen3-TTS 12 Hz directory this engine runs."""
    model_dir = Path(model_dir)
    config = _json(model_dir / "config.json")
    where = model_dir / "config.json"
    if config.get("model_type") != "qwen3_tts":
        raise ModelLoadError(f"{where}: model_type {config.get('model_type')!r} is not qwen3_tts")
    if config.get("tokenizer_type") != TOKENIZER_12HZ:
        raise ModelLoadError(f"{where}: tokenizer_type {config.get('tokenizer_type')!r}: only the 12 Hz codec "
                             f"({TOKENIZER_12HZ}) is supported")
    kind = config.get("tts_model_type")
    if kind not in KINDS:
        raise ModelLoadError(f"{where}: tts_model_type {kind!r} is not one of {', '.join(KINDS)}")
    for needed in ("speech_tokenizer/config.json", "vocab.json", "merges.txt", "model.safetensors"):
        if not (model_dir / needed).is_file():
            raise ModelLoadError(f"{model_dir}: {needed} is missing")
    ids = ModelIds.from_config(config, str(where))  # refuses a config without its ids
    speakers = {name: ids.dialects.get(name) for name in ids.speakers}
    hidden = int((config.get("talker_config") or {}).get("hidden_size", 0))
    if hidden <= 0:
        raise ModelLoadError(f"{where}: talker_config lacks hidden_size")
    gen_path = model_dir / "generation_config.json"
    generation = _json(gen_path) if gen_path.is_file() else {}
    return ModelLayout(model_dir, config, generation, kind, str(config.get("tts_model_size", "")), hidden, ids.groups,
                       ids, speakers, tuple(ids.supported_languages))

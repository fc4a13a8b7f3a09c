"""The ids a Qwen3-TTS prompt and decode are built from, read from the model dir's `config.json`.

Text-side ids (`tts_bos_token_id`, `tts_eos_token_id`, `tts_pad_token_id`) sit at the top level;
codec-side ids (the talker's control codes, its stop code, the language ids, the preset speakers
and the dialect each speaker speaks) in `talker_config`. None is assumed: a model whose config
lacks one is refused at load.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mizuoto.errors import ModelLoadError
from mizuoto_qwen3tts.weights import read_config

AUTO = "auto"  # the language that leaves the language id out (upstream's "Auto", any case)


@dataclass(frozen=True)
class ModelIds:
    """Every special id of one model, and its languages, speakers and dialects (names lower-cased)."""

    tts_bos: int
    tts_eos: int
    tts_pad: int
    codec_pad: int
    codec_bos: int
    codec_eos: int
    think: int
    nothink: int
    think_bos: int
    think_eos: int
    vocab_size: int
    groups: int
    languages: dict[str, int] = field(default_factory=dict)
    speakers: dict[str, int] = field(default_factory=dict)
    dialects: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: dict, where: str = "config.json") -> "ModelIds":
        """The ids of a parsed `config.json`."""
        try:
            talker = config["talker_config"]
            ids = cls(
                tts_bos=int(config["tts_bos_token_id"]), tts_eos=int(config["tts_eos_token_id"]),
                tts_pad=int(config["tts_pad_token_id"]),
                codec_pad=int(talker["codec_pad_id"]), codec_bos=int(talker["codec_bos_id"]),
                codec_eos=int(talker["codec_eos_token_id"]), think=int(talker["codec_think_id"]),
                nothink=int(talker["codec_nothink_id"]), think_bos=int(talker["codec_think_bos_id"]),
                think_eos=int(talker["codec_think_eos_id"]), vocab_size=int(talker["vocab_size"]),
                groups=int(talker["num_code_groups"]),
                languages={str(k).lower(): int(v) for k, v in (talker.get("codec_language_id") or {}).items()},
                speakers={str(k).lower(): int(v) for k, v in (talker.get("spk_id") or {}).items()},
                # a speaker that speaks no dialect is `false` there
                dialects={str(k).lower(): str(v).lower() for k, v in (talker.get("spk_is_dialect") or {}).items()
                          if v})
        except KeyError as exc:
            raise ModelLoadError(f"{where}: no {exc.args[0]!r} (not a Qwen3-TTS model?)") from None
        for speaker, dialect in ids.dialects.items():
            if dialect not in ids.languages:
                raise ModelLoadError(f"{where}: speaker {speaker!r} speaks dialect {dialect!r}, which has no "
                                     "codec_language_id")
        return ids

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelIds":
        """The ids of a model dir's `config.json`."""
        return cls.from_config(read_config(model_dir), str(Path(model_dir) / "config.json"))

    @property
    def supported_languages(self) -> list[str]:
        """The languages a request may name: "auto" and every language id but the dialects' (upstream's list)."""
        # upstream leaves out every language whose name says "dialect"; dialects come only with their speakers
        return [AUTO] + [name for name in self.languages if "dialect" not in name]

    @property
    def supported_speakers(self) -> list[str]:
        """The preset speakers (none for a clone or voice-design model)."""
        return sorted(self.speakers)

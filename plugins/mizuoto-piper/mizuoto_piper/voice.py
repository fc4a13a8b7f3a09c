"""A Piper voice directory: `<voice>.onnx` beside `<voice>.onnx.json`, and its phoneme-id table."""

from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from mizuoto.errors import ModelLoadError

PAD, BOS, EOS = "_", "^", "$"


def find_voice(model_dir: Path) -> tuple[Path, Path] | None:
    """The (onnx, json) pair in `model_dir` when there is exactly one; None when there is none."""
    pairs = [(p, p.with_name(p.name + ".json")) for p in sorted(Path(model_dir).glob("*.onnx"))
             if p.with_name(p.name + ".json").is_file()]
    if not pairs:
        return None
    if len(pairs) > 1:
        raise ModelLoadError(f"{model_dir} holds {len(pairs)} Piper voices ({', '.join(p.name for p, _ in pairs)});"
                             " give a directory with one")
    return pairs[0]


def is_piper_config(config: dict) -> bool:
    """True for a Piper voice config (a phoneme-id table and an espeak voice or phoneme type)."""
    return isinstance(config.get("phoneme_id_map"), dict) and ("espeak" in config or "phoneme_type" in config)


@dataclass(frozen=True)
class VoiceConfig:
    """What synthesis needs from `<voice>.onnx.json`."""

    name: str
    sample_rate: int
    espeak_voice: str
    phoneme_ids: dict[str, list[int]]
    speakers: dict[str, int]
    noise_scale: float
    length_scale: float
    noise_w: float
    language: str

    @classmethod
    def read(cls, path: Path) -> VoiceConfig:
        """Parse and check a voice config; a malformed one is a ModelLoadError naming the key."""
        try:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read Piper voice config {path}: {e}") from e
        if not isinstance(raw, dict) or not is_piper_config(raw):
            raise ModelLoadError(f"{path} is not a Piper voice config (no phoneme_id_map)")
        if raw.get("phoneme_type", "espeak") != "espeak":
            raise ModelLoadError(f"{path}: phoneme_type {raw['phoneme_type']!r} is not supported (only espeak)")
        try:
            ids = {str(k): [int(i) for i in v] for k, v in raw["phoneme_id_map"].items()}
            inference = raw.get("inference", {})
            config = cls(
                name=str(raw.get("dataset") or Path(path).name.split(".")[0]),
                sample_rate=int(raw["audio"]["sample_rate"]),
                espeak_voice=str(raw.get("espeak", {}).get("voice", "en-us")),
                phoneme_ids=ids,
                speakers={str(k): int(v) for k, v in (raw.get("speaker_id_map") or {}).items()},
                noise_scale=float(inference.get("noise_scale", 0.667)),
                length_scale=float(inference.get("length_scale", 1.0)),
                noise_w=float(inference.get("noise_w", 0.8)),
                language=str(raw.get("language", {}).get("code", "")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"{path}: malformed Piper voice config ({type(e).__name__}: {e})") from e
        for sym in (PAD, BOS, EOS):
            if sym not in ids:
                raise ModelLoadError(f"{path}: phoneme_id_map lacks the {sym!r} symbol")
        return config

    def ids(self, phonemes: str) -> list[int]:
        """Phoneme ids as Piper builds them: BOS, each phoneme followed by PAD, EOS; unknown symbols dropped."""
        pad = self.phoneme_ids[PAD]
        out = [*self.phoneme_ids[BOS], *pad]
        for ch in unicodedata.normalize("NFD", phonemes):
            if ch in self.phoneme_ids:
                out += [*self.phoneme_ids[ch], *pad]
        return out + self.phoneme_ids[EOS]

"""A LibriTTS-style recipe folder: wav.scp, text, utt2spk, spk2utt and an optional instruct list.

Lines are read as upstream's recipe tools read them: split on whitespace, the first field is
the key, the rest joined by single spaces. Every mistake a user can make in these lists is a
one-line `InvalidRequest` raised before any work starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import soundfile as sf

from mizuoto.errors import AudioError, InvalidRequest

LISTS = ("wav.scp", "text", "utt2spk", "spk2utt")
INSTRUCT = "instruct"


@dataclass(frozen=True)
class Utterance:
    """One recipe line set: key, audio path, transcript, speaker and (v3) instruction."""

    utt: str
    wav: Path
    text: str
    spk: str
    instruct: str | None = None


def _read_list(path: Path, min_fields: int = 2) -> dict[str, list[str]]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise InvalidRequest(f"{path} is missing (a recipe folder holds {', '.join(LISTS)})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"cannot read {path}: {exc}") from None
    out: dict[str, list[str]] = {}
    for n, line in enumerate(lines, 1):
        fields = line.split()
        if not fields:
            continue
        if len(fields) < min_fields:
            raise InvalidRequest(f"{path}:{n}: {fields[0]!r} has no value")
        if fields[0] in out:
            raise InvalidRequest(f"{path}:{n}: {fields[0]!r} is listed twice")
        out[fields[0]] = fields[1:]
    return out


def read_recipe(data_dir: str | Path) -> list[Utterance]:
    """Every utterance of the folder, in wav.scp order, checked against the other lists."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise InvalidRequest(f"data folder {data_dir} does not exist")
    wavs = _read_list(data_dir / "wav.scp")
    texts = _read_list(data_dir / "text")
    spks = _read_list(data_dir / "utt2spk")
    _read_list(data_dir / "spk2utt")
    instructs = _read_list(data_dir / INSTRUCT) if (data_dir / INSTRUCT).is_file() else None
    if not wavs:
        raise InvalidRequest(f"{data_dir / 'wav.scp'} lists no utterance")
    out = []
    for utt, fields in wavs.items():
        if utt not in texts:
            raise InvalidRequest(f"{data_dir / 'wav.scp'}: utterance {utt!r} has no line in {data_dir / 'text'}")
        if utt not in spks:
            raise InvalidRequest(f"{data_dir / 'wav.scp'}: utterance {utt!r} has no speaker in {data_dir / 'utt2spk'}")
        if instructs is not None and utt not in instructs:
            raise InvalidRequest(f"{data_dir / INSTRUCT}: utterance {utt!r} has no instruction")
        wav = Path(fields[0])
        wav = wav if wav.is_absolute() else data_dir / wav
        out.append(Utterance(utt, wav, " ".join(texts[utt]), spks[utt][0],
                             " ".join(instructs[utt]) if instructs is not None else None))
    return out


def check_audio(utts: list[Utterance]) -> dict[str, tuple[int, int]]:
    """(frames, sample rate) of every wav, read from its header; a missing or unreadable one is an error."""
    info = {}
    for u in utts:
        if not u.wav.is_file():
            raise AudioError(f"{u.utt}: audio file not found: {u.wav}")
        try:
            meta = sf.info(str(u.wav))
        except (sf.LibsndfileError, RuntimeError) as exc:
            raise AudioError(f"{u.utt}: cannot read audio {u.wav}: {getattr(exc, 'error_string', exc)}") from None
        if meta.frames == 0:
            raise AudioError(f"{u.utt}: audio {u.wav} contains no samples")
        info[u.utt] = (int(meta.frames), int(meta.samplerate))
    return info

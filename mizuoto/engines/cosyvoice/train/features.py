"""The features stage: speech tokens and CAM++ embeddings of every recipe utterance.

What upstream's tools/extract_speech_token.py and tools/extract_embedding.py write, computed by
Mizuoto's own S3 tokenizer and CAM++ blocks (the front end's), on one thread; CAM++ runs in
onnxruntime's CPU float32 order (nn/speaker/campplus_ort.py), so the embeddings are upstream's:
`utt2speech_token.pt` (utt -> token ids), `utt2embedding.pt` (utt -> 192 floats) and
`spk2embedding.pt` (speaker -> the float32 mean of its utterances' embeddings). The three files
are written only once every utterance has its features.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Callable

import torch

from mizuoto.engines.cosyvoice.frontend import CosyVoiceFrontend
from mizuoto.engines.cosyvoice.train.recipe import Utterance, check_audio
from mizuoto.engines.cosyvoice.variants import Variant
from mizuoto.errors import AudioError, ModelLoadError
from mizuoto.files import atomic_write_bytes

FILES = ("utt2speech_token.pt", "utt2embedding.pt", "spk2embedding.pt")


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def extract_features(model_dir: Path, variant: Variant, config: dict, utts: list[Utterance],
                     progress: Callable[[int, int], None] | None = None) -> tuple[dict, dict, dict]:
    """(utt2speech_token, utt2embedding, spk2embedding) as upstream's tools build them."""
    token_rate = token_frame_rate(config)
    for utt, (frames, rate) in check_audio(utts).items():
        if frames * token_rate < rate:
            raise AudioError(f"{utt}: audio of {frames / rate * 1000:.0f} ms is shorter than one speech token "
                             f"({1000 / token_rate:.0f} ms)")
    frontend = CosyVoiceFrontend(model_dir, variant, config)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # upstream's onnxruntime sessions run one intra-op thread
    try:
        utt2token, utt2emb, spk_embs = {}, {}, {}
        for i, u in enumerate(utts):
            tokens = frontend.speech_tokens(u.wav).flatten().tolist()
            if not tokens:
                raise AudioError(f"{u.utt}: audio {u.wav} is shorter than one speech token")
            embedding = frontend.speaker_embedding(u.wav, onnxruntime_order=True).flatten().tolist()
            utt2token[u.utt] = tokens
            utt2emb[u.utt] = embedding
            spk_embs.setdefault(u.spk, []).append(embedding)
            if progress is not None:
                progress(i + 1, len(utts))
    finally:
        torch.set_num_threads(threads)
    spk2emb = {spk: torch.tensor(v).mean(dim=0).tolist() for spk, v in spk_embs.items()}
    return utt2token, utt2emb, spk2emb


def token_frame_rate(config: dict) -> float:
    """Speech tokens per second (the flow's input_frame_rate in the yaml)."""
    flow = config.get("flow")
    rate = flow.get("input_frame_rate") if flow is not None else None
    if rate is None:
        raise ModelLoadError("the yaml's flow has no input_frame_rate (speech tokens per second)")
    return float(rate)


def write_features(dest: Path, features: tuple[dict, dict, dict]) -> None:
    """Write the three feature files into dest, each atomically."""
    dest.mkdir(parents=True, exist_ok=True)
    for name, obj in zip(FILES, features):
        atomic_write_bytes(dest / name, _saved(obj))


def load_features(folder: Path) -> tuple[dict, dict, dict] | None:
    """The three feature files of a folder, or None when it holds none of them."""
    present = [(folder / n).is_file() for n in FILES]
    if not any(present):
        return None
    if not all(present):
        missing = [n for n, p in zip(FILES, present) if not p]
        raise AudioError(f"{folder}: feature files incomplete, missing {', '.join(missing)} "
                         "(run --stage features)")
    return tuple(torch.load(folder / n, map_location="cpu", weights_only=True) for n in FILES)

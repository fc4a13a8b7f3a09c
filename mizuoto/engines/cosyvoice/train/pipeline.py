"""The training data pipeline: upstream's dataset processors over a recipe folder and its features.

The yaml's `data_pipeline` names the processors in order (upstream's cosyvoice.dataset.processor
functions); each is implemented here with the same effect and the same random draws:
`shuffle` calls the global `random.shuffle` once per buffer (so in the main process with no
loader workers, in each worker otherwise, where torch seeds `random` per worker), `sort` is a
stable sort by mel frames, `padding` orders a batch by audio length, longest first.

Utterances are grouped into shards of `SHARD_SIZE` in wav.scp order (upstream's parquet files);
shards are spread over loader workers as upstream's DataList does: every worker reads all
shards when there are fewer shards than workers.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import IterableDataset, get_worker_info

from mizuoto.engines.cosyvoice.train.recipe import Utterance
from mizuoto.errors import InvalidRequest
from mizuoto.nn.dsp.mel import MatchaMelConfig, matcha_mel
from mizuoto.nn.dsp.resample import resample
from mizuoto.nn.dsp.wav import read_audio

SHARD_SIZE = 1000           # make_parquet_list.py's num_utts_per_parquet
MIN_SOURCE_RATE = 16000     # upstream's resample drops audio below this rate
Sample = dict[str, Any]


def tokenize(data: Iterator[Sample], encode: Callable[[str], list[int]]) -> Iterator[Sample]:
    """text (and instruct) -> token ids."""
    for s in data:
        s["text_token"] = encode(s["text"])
        if "instruct" in s:
            s["instruct_token"] = encode(s["instruct"])
        yield s


def filter_samples(data: Iterator[Sample], max_length: float = 10240, min_length: float = 10,
                   token_max_length: int = 200, token_min_length: int = 1,
                   min_output_input_ratio: float = 0.0005, max_output_input_ratio: float = 1) -> Iterator[Sample]:
    """Read the audio (mono float32) and drop utterances outside the length limits (in 10 ms frames)."""
    for s in data:
        audio, rate = read_audio(s["wav"])
        s["speech"], s["sample_rate"] = audio.mean(dim=0, keepdim=True), rate
        frames = s["speech"].size(1) / rate * 100
        n_text = len(s["text_token"])
        if not (min_length <= frames <= max_length) or not (token_min_length <= n_text <= token_max_length):
            continue
        if frames != 0 and not (min_output_input_ratio <= n_text / frames <= max_output_input_ratio):
            continue
        yield s


def resample_samples(data: Iterator[Sample], resample_rate: int = 22050,
                     min_sample_rate: int = MIN_SOURCE_RATE) -> Iterator[Sample]:
    """Bring the audio to the model's rate; scale it down if it peaks above 1."""
    for s in data:
        if s["sample_rate"] != resample_rate:
            if s["sample_rate"] < min_sample_rate:
                continue
            s["speech"] = resample(s["speech"], s["sample_rate"], resample_rate)
            s["sample_rate"] = resample_rate
        peak = s["speech"].abs().max()
        if peak > 1:
            s["speech"] /= peak
        yield s


def compute_fbank(data: Iterator[Sample], mel: MatchaMelConfig, num_frames: int = -1) -> Iterator[Sample]:
    """speech_feat (frames, mels): the Matcha mel; with num_frames, audio zero-padded to a multiple of it first."""
    for s in data:
        if num_frames != -1:
            n = int(math.ceil(s["speech"].shape[1] / num_frames)) * num_frames
            s["speech"] = torch.concat([s["speech"], torch.zeros(1, n - s["speech"].shape[1])], dim=1)
        s["speech_feat"] = matcha_mel(s["speech"], mel).squeeze(dim=0).transpose(0, 1)
        yield s


def compute_whisper_fbank(data: Iterator[Sample], num_frames: int = -1) -> Iterator[Sample]:
    """Upstream's Whisper features feed its online token extraction, which never runs here (the
    rows carry speech tokens), so only its alignment check is kept; it draws nothing."""
    for s in data:
        if num_frames != -1 and s["speech"].shape[1] % num_frames != 0:
            raise InvalidRequest(f"{s['utt']}: audio length is not a multiple of {num_frames} samples")
        yield s


def parse_embedding(data: Iterator[Sample], normalize: bool) -> Iterator[Sample]:
    """Utterance and speaker embeddings as float32 tensors, L2-normalized if asked."""
    for s in data:
        for key in ("utt_embedding", "spk_embedding"):
            s[key] = torch.tensor(s[key], dtype=torch.float32)
            if normalize:
                s[key] = F.normalize(s[key], dim=0)
        yield s


def shuffle(data: Iterator[Sample], shuffle_size: int = 10000) -> Iterator[Sample]:
    """Buffer-local shuffle with the global `random`: half a full buffer out at a time, the rest at the end."""
    buf: list[Sample] = []
    for s in data:
        buf.append(s)
        if len(buf) >= shuffle_size:
            random.shuffle(buf)
            half = int(shuffle_size / 2)
            yield from buf[:half]
            buf = buf[half:]
    random.shuffle(buf)
    yield from buf


def sort(data: Iterator[Sample], sort_size: int = 500) -> Iterator[Sample]:
    """Stable sort by mel frames within buffers of sort_size."""
    buf: list[Sample] = []
    for s in data:
        buf.append(s)
        if len(buf) >= sort_size:
            buf.sort(key=lambda x: x["speech_feat"].size(0))
            yield from buf
            buf = []
    buf.sort(key=lambda x: x["speech_feat"].size(0))
    yield from buf


def batch(data: Iterator[Sample], batch_type: str = "static", batch_size: int = 16,
          max_frames_in_batch: int = 12000) -> Iterator[list[Sample]]:
    """Static batches of batch_size, or dynamic ones whose padded mel frames stay within max_frames_in_batch."""
    if batch_type not in ("static", "dynamic"):
        raise InvalidRequest(f"batch_type {batch_type!r} is not static or dynamic")
    buf: list[Sample] = []
    longest = 0
    for s in data:
        if batch_type == "static":
            buf.append(s)
            if len(buf) >= batch_size:
                yield buf
                buf = []
            continue
        frames = s["speech_feat"].size(0)
        longest = max(longest, frames)
        if longest * (len(buf) + 1) > max_frames_in_batch:
            yield buf
            buf, longest = [s], frames
        else:
            buf.append(s)
    if buf:
        yield buf


def _padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return (pad_sequence(rows, batch_first=True, padding_value=0),
            torch.tensor([r.size(0) for r in rows], dtype=torch.int32))


def padding(data: Iterator[list[Sample]], use_spk_embedding: bool) -> Iterator[dict[str, Any]]:
    """A batch dict as upstream's padding builds it, utterances ordered by audio length (longest first)."""
    for samples in data:
        lengths = torch.tensor([x["speech"].size(1) for x in samples], dtype=torch.int32)
        order = [samples[i] for i in torch.argsort(lengths, descending=True)]
        out: dict[str, Any] = {"utts": [x["utt"] for x in order], "text": [x["text"] for x in order]}
        out["text_token"], out["text_token_len"] = _padded([torch.tensor(x["text_token"]) for x in order])
        out["speech_feat"], out["speech_feat_len"] = _padded([x["speech_feat"] for x in order])
        out["utt_embedding"] = torch.stack([x["utt_embedding"] for x in order], dim=0)
        out["spk_embedding"] = torch.stack([x["spk_embedding"] for x in order], dim=0)
        if all("instruct_token" in x for x in order):
            out["instruct_token"], out["instruct_token_len"] = _padded(
                [torch.tensor(x["instruct_token"]) for x in order])
        if all("speech_token" in x for x in order):
            out["speech_token"], out["speech_token_len"] = _padded([torch.tensor(x["speech_token"]) for x in order])
        out["embedding"] = out["spk_embedding"] if use_spk_embedding else out["utt_embedding"]
        yield out


@dataclass(frozen=True)
class Stage:
    """One processor of the pipeline and its keyword arguments."""

    name: str
    run: Callable
    kwargs: dict[str, Any]


_SKIPPED = frozenset({"parquet_opener"})  # the rows come from the recipe lists or parquet.py
_PROCESSORS: dict[str, Callable] = {
    "tokenize": tokenize, "filter": filter_samples, "resample": resample_samples,
    "compute_fbank": compute_fbank, "compute_whisper_fbank": compute_whisper_fbank,
    "parse_embedding": parse_embedding, "shuffle": shuffle,
    "sort": sort, "batch": batch, "padding": padding,
}


def pipeline_stages(config: dict, encode: Callable[[str], list[int]]) -> list[Stage]:
    """The yaml's data_pipeline as stages; a processor this trainer does not implement is an error."""
    nodes = config.get("data_pipeline")
    if not isinstance(nodes, list) or not nodes:
        raise InvalidRequest("the training yaml has no data_pipeline list")
    stages = []
    for node in nodes:
        name = getattr(node, "cls", None)
        if name in _SKIPPED:
            continue
        if name not in _PROCESSORS:
            raise InvalidRequest(f"data_pipeline: processor {getattr(node, 'target', node)!r} is not supported")
        kwargs = dict(node.kwargs)
        kwargs.pop("mode", None)
        if name == "tokenize":
            kwargs = {"encode": encode}
        elif name == "compute_fbank":
            feat = kwargs.pop("feat_extractor")
            kwargs["mel"] = MatchaMelConfig.from_kwargs(feat.kwargs)
        stages.append(Stage(name, _PROCESSORS[name], kwargs))
    return stages


def recipe_rows(utts: list[Utterance], features: tuple[dict, dict, dict]) -> list[dict]:
    """The per-utterance rows upstream's parquet holds, from the recipe lists and the feature files."""
    tokens, utt_emb, spk_emb = features
    rows = []
    for u in utts:
        for what, table, key in (("speech tokens", tokens, u.utt), ("an embedding", utt_emb, u.utt),
                                 ("a speaker embedding", spk_emb, u.spk)):
            if key not in table:
                raise InvalidRequest(f"{u.utt}: the feature files hold no {what} for {key!r} (run --stage features)")
        row = {"utt": u.utt, "wav": str(u.wav), "text": u.text, "spk": u.spk,
               "utt_embedding": utt_emb[u.utt], "spk_embedding": spk_emb[u.spk],
               "speech_token": list(tokens[u.utt])}
        if u.instruct is not None:
            row["instruct"] = u.instruct
        rows.append(row)
    return rows


def shard_rows(rows: list[dict]) -> list[list[dict]]:
    """Consecutive shards of SHARD_SIZE rows."""
    return [rows[i:i + SHARD_SIZE] for i in range(0, len(rows), SHARD_SIZE)]


class TrainData(IterableDataset):
    """The whole pipeline as a torch IterableDataset: torch's DataLoader then seeds and interleaves workers."""

    def __init__(self, shards: list[list[dict]], stages: list[Stage], shuffle_shards: bool, partition: bool) -> None:
        self.shards = shards
        self.stages = stages
        self.shuffle_shards = shuffle_shards
        self.partition = partition
        self.epoch = -1

    def set_epoch(self, epoch: int) -> None:
        """The epoch seeds the shard-order shuffle, as upstream's DistributedSampler."""
        self.epoch = epoch

    def _shard_indexes(self) -> list[int]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        idx = list(range(len(self.shards)))
        if self.partition and self.shuffle_shards:
            random.Random(self.epoch).shuffle(idx)  # world size 1: every shard stays on this rank
        if len(idx) < workers:
            idx = (idx * math.ceil(workers / len(idx)))[:workers]
        return idx[worker::workers]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        data: Iterator = (dict(row) for shard in self._shard_indexes() for row in self.shards[shard])  # the opener
        for stage in self.stages:
            data = stage.run(data, **stage.kwargs)
        return data

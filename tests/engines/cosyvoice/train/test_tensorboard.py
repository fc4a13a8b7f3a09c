"""The hand-written TensorBoard event file: valid TFRecord framing, and upstream's scalars at upstream's steps."""

from __future__ import annotations

import json
import struct

import numpy as np

from mizuoto.engines.cosyvoice.train.session import StageSpec, run_training
from mizuoto.engines.cosyvoice.train.tensorboard import crc32c, masked_crc
from mizuoto.testing.train_cases import assert_same_float, fewest_workers


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i


def _fields(buf: bytes) -> list[tuple[int, object]]:
    out, i = [], 0
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 1:
            value, i = buf[i:i + 8], i + 8
        elif wire == 5:
            value, i = buf[i:i + 4], i + 4
        else:
            n, i = _varint(buf, i)
            value, i = buf[i:i + n], i + n
        out.append((number, value))
    return out


def read_scalars(path) -> list[tuple[str, int, float]]:
    data, i, events = path.read_bytes(), 0, []
    while i < len(data):
        length = data[i:i + 8]
        (n,) = struct.unpack("<Q", length)
        assert struct.unpack("<I", data[i + 8:i + 12])[0] == masked_crc(length)
        event = data[i + 12:i + 12 + n]
        assert struct.unpack("<I", data[i + 12 + n:i + 16 + n])[0] == masked_crc(event)
        i += 16 + n
        events.append(dict(_fields(event)))
    assert events and events[0][3] == b"brain.Event:2"
    scalars = []
    for e in events[1:]:
        value = dict(_fields(dict(_fields(e[5]))[1]))
        scalars.append((value[1].decode(), e[2], struct.unpack("<f", value[2])[0]))
    return scalars


def test_crc32c_known_value():
    assert crc32c(b"123456789") == 0xE3069283


def test_scalars_are_upstreams(assembled, tmp_path):
    runs = fewest_workers()
    assert runs
    run, workers = runs[0]
    spec = StageSpec(run.name, assembled(run.parent), run.parent / "data", tmp_path, run / "train.yaml", workers=workers)
    run_training(spec)
    files = sorted((tmp_path / run.name / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 1
    scalars = read_scalars(files[0])
    ref = json.loads((run / f"metrics_w{workers}.json").read_text(encoding="utf-8"))
    want = [(r["step"] + 1, r["loss"]["value"]) for r in ref["train"] if r["boundary"]]
    got = [(step, v) for tag, step, v in scalars if tag == "TRAIN/loss"]
    assert want and [s for s, _ in got] == [s for s, _ in want]
    for (step, v), (_, w) in zip(got, want):
        assert_same_float(np.float32(v), np.float32(w), f"TRAIN/loss at {step}")
    cv = [(step, v) for tag, step, v in scalars if tag == "CV/loss"]
    assert [s for s, _ in cv] == [s["step"] + 1 for s in ref["cv_summary"]]
    for (step, v), s in zip(cv, ref["cv_summary"]):
        assert_same_float(np.float32(v), np.float32(s["loss_dict"]["loss"]), f"CV/loss at {step}")

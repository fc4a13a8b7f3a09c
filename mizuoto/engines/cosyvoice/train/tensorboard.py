"""A TensorBoard scalar log without TensorBoard: `events.out.tfevents.*` records written by hand.

Each record is length (uint64 LE), masked CRC-32C of the length, an `Event` protobuf, masked
CRC-32C of it. Only the fields scalars need are encoded: wall_time (1, double), step (2,
int64), file_version (3, string) on the first event, summary (5) with values of tag (1) and
simple_value (2, float). Scalars are what upstream's SummaryWriter records: TRAIN/* on
optimizer steps and CV/* after each validation pass, at step + 1.
"""

from __future__ import annotations

import struct
import time
from pathlib import Path


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of data."""
    c = 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    """TFRecord's masked CRC-32C."""
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    out = bytearray()
    n &= (1 << 64) - 1
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field(number: int, wire: int) -> bytes:
    return _varint((number << 3) | wire)


def _length_delimited(number: int, payload: bytes) -> bytes:
    return _field(number, 2) + _varint(len(payload)) + payload


def scalar_event(tag: str, value: float, step: int, wall_time: float) -> bytes:
    """A serialized Event holding one scalar summary value."""
    summary_value = _length_delimited(1, tag.encode("utf-8")) + _field(2, 5) + struct.pack("<f", value)
    summary = _length_delimited(1, summary_value)
    return (_field(1, 1) + struct.pack("<d", wall_time) + _field(2, 0) + _varint(step)
            + _length_delimited(5, summary))


def version_event(wall_time: float) -> bytes:
    """The first Event of a file: its format version."""
    return _field(1, 1) + struct.pack("<d", wall_time) + _length_delimited(3, b"brain.Event:2")


def record(event: bytes) -> bytes:
    """One TFRecord framing an Event."""
    length = struct.pack("<Q", len(event))
    return length + struct.pack("<I", masked_crc(length)) + event + struct.pack("<I", masked_crc(event))


class ScalarLog:
    """Appends scalars to one event file in `folder` (created on first use)."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.path: Path | None = None

    def add(self, tag: str, value: float, step: int) -> None:
        """Record `tag` = value at step."""
        now = time.time()
        if self.path is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.path = self.folder / f"events.out.tfevents.{int(now)}.mizuoto"
            self.path.write_bytes(record(version_event(now)))
        with self.path.open("ab") as f:
            f.write(record(scalar_event(tag, float(value), int(step), now)))

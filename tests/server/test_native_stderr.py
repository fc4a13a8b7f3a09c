"""libmpg123 (inside libsndfile) prints notes about an mp3 straight to stderr: the server logs them as records."""

from __future__ import annotations

import logging
import os

import numpy as np

from mizuoto.nn.dsp.encode import encode
from mizuoto.server.audio import decode_reference
from mizuoto.server.native_stderr import routed_stderr


def test_libmpg123_notes_on_a_client_mp3_become_debug_records(capfd, caplog):
    """An mp3 with a damaged middle decodes (libmpg123 resyncs and says so); nothing raw reaches stderr."""
    t = np.arange(48000) / 16000
    body = encode((0.3 * np.sin(2 * np.pi * 180 * t)).astype(np.float32), 16000, "mp3")
    damaged = body[:500] + body[2000:]  # libmpg123: "Note: Illegal Audio-MPEG-Header ... Trying to resync..."
    with caplog.at_level(logging.DEBUG, logger="mizuoto.server"):
        samples, rate = decode_reference(damaged, "ref_audio")
    assert rate == 16000 and samples.numel() > 16000
    err = capfd.readouterr().err
    assert "Note:" not in err and "Warning:" not in err and "libmpg123" not in err, err
    notes = [r.getMessage() for r in caplog.records if r.name == "mizuoto.server"]
    assert any(m.startswith("libmpg123 decoding ref_audio: Note: ") for m in notes), notes


def test_other_lines_written_meanwhile_go_on_to_stderr(capfd, caplog):
    """Only libmpg123's lines are taken: another thread's line written during a decode reaches stderr unchanged."""
    with caplog.at_level(logging.DEBUG, logger="test.native"):
        with routed_stderr(logging.getLogger("test.native"), "decoding"):
            os.write(2, b"Note: Trying to resync...\nINFO:     a log line of another thread\npartial")
    assert capfd.readouterr().err == "INFO:     a log line of another thread\npartial"
    assert [r.getMessage() for r in caplog.records] == ["decoding: Note: Trying to resync..."]

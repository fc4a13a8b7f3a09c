"""`python -m mizuoto.demo` writes a wav and says which engine made it."""

import soundfile

from mizuoto import demo


def test_demo_writes_a_wav(tmp_path, capsys):
    out = tmp_path / "demo.wav"
    assert demo.main(out) == 0
    stdout = capsys.readouterr().out
    assert stdout.startswith(f"demo: wrote {out} with ")
    assert ("CosyVoice fixture model" in stdout) or ("toy sine-tone engine" in stdout)
    info = soundfile.info(out)
    assert info.frames > 0 and info.samplerate > 0

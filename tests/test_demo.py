"""`python -m mizuoto.demo` writes a wav and says which engine made it."""

import soundfile

from mizuoto import demo
from mizuoto.testing.fixtures import fixtures_root


def test_demo_speaks_with_piper_by_default(tmp_path, capsys):
    out = tmp_path / "demo.wav"
    assert demo.main([], out=out) == 0
    stdout = capsys.readouterr().out
    assert stdout.startswith(f"demo: wrote {out} with Piper")
    info = soundfile.info(out)
    assert info.frames > info.samplerate  # a sentence lasts more than a second


def test_demo_speaks_with_a_given_model_dir(tmp_path, capsys):
    model_dir = next(d for d in sorted(fixtures_root().glob("cosyvoice/*/model")) if (d / "spk2info.pt").is_file())
    out = tmp_path / "demo.wav"
    assert demo.main([str(model_dir), "-o", str(out)]) == 0
    assert "(cosyvoice), voice" in capsys.readouterr().out
    assert soundfile.info(out).frames > 0

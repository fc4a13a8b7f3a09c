"""The mizuoto-piper plugin as installed: registration, phonemes, speech that sounds like speech, its memory formula."""

import ast
import json
import threading
from importlib import metadata
from pathlib import Path

import pytest
import torch

from mizuoto.runtime.api import Runtime
from mizuoto.runtime.lease import Lease
from mizuoto.errors import InvalidRequest, ModelLoadError

TEXT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def rt():
    """A Runtime with the default voice loaded as 'piper', on the CPU."""
    import mizuoto_piper

    runtime = Runtime()
    runtime.load(mizuoto_piper.default_voice_dir(), name="piper", device="cpu")
    yield runtime
    runtime.close()


def _speech_band_fraction(audio: torch.Tensor, rate: int) -> float:
    spectrum = torch.fft.rfft(audio.double()).abs() ** 2
    freqs = torch.fft.rfftfreq(audio.numel(), 1 / rate)
    band = (freqs >= 80) & (freqs <= 5000)
    return float(spectrum[band].sum() / spectrum.sum())


def test_registered_only_by_entry_point():
    """The plugin is an installed distribution whose `mizuoto.engines` entry point names the package."""
    eps = {ep.name: ep for ep in metadata.entry_points(group="mizuoto.engines")}
    assert eps["piper"].value == "mizuoto_piper" and eps["piper"].dist.name == "mizuoto-piper"
    assert "onnxruntime" not in Path(__file__).parents[3].joinpath("pyproject.toml").read_text()


def test_uses_only_public_api():
    """Every mizuoto import in the plugin is from the public modules."""
    import mizuoto_piper

    allowed = {"mizuoto.runtime.engine", "mizuoto.errors", "mizuoto.runtime.hookspecs"}
    for path in Path(mizuoto_piper.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mizuoto."):
                assert node.module in allowed, f"{path.name} imports {node.module}"
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("mizuoto.") for a in node.names), path.name


def test_cli_lists_piper(capsys):
    """`mizuoto engines` lists piper with its plugin name and capabilities."""
    from mizuoto.cli.main import main

    assert main(["engines"]) == 0
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith("piper"))
    assert "[piper]" in line and "22050 Hz" in line and "stream out" in line


def test_phonemes_keep_punctuation():
    """espeak-ng IPA per sentence, with clause punctuation put back; numbers stay whole."""
    from mizuoto_piper.phonemize import phonemize

    out = phonemize("Hello world, again. It costs 3.5 dollars! Right?")
    assert len(out) == 3
    assert out[0].endswith(".") and "," in out[0] and out[1].endswith("!") and out[2].endswith("?")
    assert "pɔɪnt" in out[1]  # "3.5" read as "three point five", not split into two sentences


def test_phoneme_ids_layout(rt):
    """BOS, then each phoneme followed by the pad, then EOS; unknown symbols are dropped."""
    config = rt.model("piper").config
    ids = config.ids("ab\u2603")
    pad, bos, eos = config.phoneme_ids["_"], config.phoneme_ids["^"], config.phoneme_ids["$"]
    assert ids == [*bos, *pad, *config.phoneme_ids["a"], *pad, *config.phoneme_ids["b"], *pad, *eos]


def test_speaks(rt):
    """Non-silent, speech-band audio of plausible length at the voice's rate."""
    chunks = list(rt.synthesize("piper", TEXT, voice="joe", seed=7))
    assert len(chunks) == 1 and chunks[0].final and chunks[0].sample_rate == 22050
    audio = chunks[0].samples
    seconds = audio.numel() / 22050
    assert len(TEXT) / 25 < seconds < len(TEXT) / 6, seconds  # 6-25 characters per second
    assert float(audio.pow(2).mean().sqrt()) > 0.02
    assert float(audio.abs().max()) <= 1.5
    assert _speech_band_fraction(audio, 22050) > 0.9
    # Speech has pauses and syllables: the 20 ms frame energy varies a lot.
    frames = audio[: audio.numel() // 441 * 441].reshape(-1, 441).pow(2).mean(1)
    assert float(frames.max() / frames.median().clamp_min(1e-9)) > 4


def test_speed_and_seed(rt):
    """speed 2 about halves the length; a seed repeats the audio exactly and another seed differs."""
    one = list(rt.synthesize("piper", TEXT, voice="joe", seed=1))[0].samples
    again = list(rt.synthesize("piper", TEXT, voice="joe", seed=1))[0].samples
    other = list(rt.synthesize("piper", TEXT, voice="joe", seed=2))[0].samples
    fast = list(rt.synthesize("piper", TEXT, voice="joe", seed=1, speed=2.0))[0].samples
    assert torch.equal(one, again) and not torch.equal(one, other)
    assert 0.35 < fast.numel() / one.numel() < 0.65


def test_streams_per_sentence(rt):
    """Streaming yields a chunk per sentence; text in pieces works the same."""
    text = "First sentence. Second one here! And a third?"
    chunks = list(rt.synthesize("piper", text, voice="joe", stream=True, seed=3))
    assert len(chunks) == 3 and [c.final for c in chunks] == [False, False, True]
    pieces = iter(["First sen", "tence. Second", " one here! And a third?"])
    streamed = list(rt.synthesize("piper", pieces, voice="joe", stream=True, seed=3))
    assert len(streamed) == 3
    assert all(torch.equal(a.samples, b.samples) for a, b in zip(chunks, streamed))


def test_long_sentence_is_cut(rt, monkeypatch):
    """A sentence past MAX_IDS runs in bounded parts and still speaks all of it."""
    import mizuoto_piper.engine as engine
    from mizuoto_piper.phonemize import phonemize

    monkeypatch.setattr(engine, "MAX_IDS", 40)
    text = "one more word and then another word again"
    config = rt.model("piper").config
    parts = engine._split_long(phonemize(text)[0], config, engine.run_limit(1.0))
    assert len(parts) >= 3 and all(len(config.ids(p)) <= 40 for p in parts)
    chunks = list(rt.synthesize("piper", text, voice="joe", seed=1, stream=True))
    assert len(chunks) == len(parts)
    assert sum(c.samples.numel() for c in chunks) / 22050 > len(text) / 25


def test_memory_formula(rt):
    """Working memory is declared by formula: the session plus one bounded run, growing with the sentence."""
    from dataclasses import replace

    from mizuoto.runtime.engine import SynthesisRequest
    from mizuoto_piper.engine import vits_bytes

    model = rt.model("piper")
    vits = model.stage("vits")
    short, long = SynthesisRequest("Hi.", voice="joe"), SynthesisRequest("word " * 300, voice="joe")
    bound = vits.working_memory(None)
    assert model.onnx_bytes < vits.working_memory(short) < vits.working_memory(long) <= bound
    assert bound == vits_bytes(model.onnx_bytes, 10**9)
    assert vits.working_memory(replace(long, text="Hi. " * 200)) < vits.working_memory(long)  # per sentence
    slow = replace(short, text="A few more words.", speed=0.25)
    assert vits.working_memory(replace(slow, speed=1.0)) < vits.working_memory(slow) <= bound  # more frames per id
    assert rt.plan("piper").peak >= bound


def test_refuses_what_it_cannot_do(rt):
    """Only preset voices; unknown voices fail before any work."""
    with pytest.raises(InvalidRequest, match="unknown voice"):
        rt.synthesize("piper", TEXT, voice="alloy")
    with pytest.raises(InvalidRequest, match="does not support mode"):
        rt.synthesize("piper", TEXT, voice="joe", instruct="whisper")


def test_detect_and_load_errors(tmp_path):
    """Foreign, broken or ambiguous directories are refused with a clear error."""
    import mizuoto_piper
    from mizuoto_piper.engine import PiperEngine

    engine = PiperEngine()
    assert not engine.detect(tmp_path)
    src = mizuoto_piper.default_voice_dir()
    config = json.loads((src / "en_US-joe-medium.onnx.json").read_text())
    (tmp_path / "v.onnx").write_bytes(b"not an onnx file")
    (tmp_path / "v.onnx.json").write_text(json.dumps(config))
    assert engine.detect(tmp_path)
    with pytest.raises(ModelLoadError, match="cannot load Piper voice"):
        engine.load(tmp_path, None)
    (tmp_path / "w.onnx").write_bytes(b"x")
    (tmp_path / "w.onnx.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="2 Piper voices"):
        engine.load(tmp_path, None)
    for f in tmp_path.iterdir():
        f.unlink()
    (tmp_path / "v.onnx").write_bytes(b"x")
    (tmp_path / "v.onnx.json").write_text(json.dumps({"audio": {"sample_rate": 22050}}))
    assert not engine.detect(tmp_path)


def test_a_request_waiting_for_streamed_text_holds_the_voice_from_no_one(rt):
    """Requests interleave: one whose streamed text has not come holds no turn, and a request after it
    finishes meanwhile (it waited for the first's text deadline before: issue 29's dripping sessions)."""
    waiting, more = threading.Event(), threading.Event()

    def pieces():
        yield "First sentence. "
        waiting.set()  # the voice has the first sentence; the rest comes when the test says
        assert more.wait(30)
        yield "Second one."

    out: dict = {}
    first = threading.Thread(target=lambda: out.setdefault(
        "first", list(rt.synthesize("piper", pieces(), voice="joe", stream=True, seed=3))))
    first.start()
    try:
        assert waiting.wait(30)
        alone = list(rt.synthesize("piper", TEXT, voice="joe", seed=1, lease=Lease(timeout=20)))
        assert not out and len(alone) == 1 and alone[0].samples.numel() > 0  # done while the first waits
    finally:
        more.set()
        first.join(30)
    assert [c.final for c in out["first"]] == [False, True]
    again = list(rt.synthesize("piper", "First sentence. Second one.", voice="joe", stream=True, seed=3))
    assert all(torch.equal(a.samples, b.samples) for a, b in zip(out["first"], again))  # interleaving changed nothing
    assert torch.equal(alone[0].samples, list(rt.synthesize("piper", TEXT, voice="joe", seed=1))[0].samples)

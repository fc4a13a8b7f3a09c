"""`python -m mizuoto.demo` (what `make demo` runs) speaks with every kind of model directory and names what it used.

Kinds: the demo voice a plugin offers (Piper), every CosyVoice fixture model that ships preset
voices as it is (v1 SFT), and every CosyVoice fixture model assembled into a complete directory
(tests/contract/conftest.py does the same), each with and without a reference clip.
"""

import ast
import atexit
import functools
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import soundfile

from mizuoto import demo
from mizuoto.runtime.api import Runtime
from mizuoto.testing.cosyvoice_cases import assemble_model_dir
from mizuoto.testing.fixtures import fixtures_root

_REPO = Path(__file__).resolve().parents[1]
_BARE = sorted(p for p in fixtures_root().glob("cosyvoice/*/model") if p.is_dir())
_TMP = Path(tempfile.mkdtemp(prefix="mizuoto-demo-models-"))
atexit.register(shutil.rmtree, _TMP, ignore_errors=True)
# Upstream SFT/Instruct directories ship their preset speakers in spk2info.pt; they load as they are.
WITH_PRESETS = [d for d in _BARE if (d / "spk2info.pt").is_file()]
ASSEMBLED = [assemble_model_dir(d, _TMP / d.parent.name / "model") for d in _BARE]
MODEL_DIRS = WITH_PRESETS + ASSEMBLED


def _id(d: Path) -> str:
    return f"{d.parent.name}-{'assembled' if d.is_relative_to(_TMP) else 'as-shipped'}"


def test_model_kinds_are_discovered():
    assert _BARE and WITH_PRESETS and len(ASSEMBLED) == len(_BARE)


@functools.cache
def _facts(model_dir: Path) -> tuple[str, list[str], frozenset[str]]:
    """(engine, preset voice ids, modes) of a model directory, asked of the runtime."""
    with Runtime() as rt:
        name = rt.load(model_dir, device="cpu")
        return (rt.info(name).engine, [v.id for v in rt.voices(name) if v.kind == "preset"],
                rt.model(name).capabilities.modes)


SHORT = "Hello there."  # the random-weight models speak as long as the text allows: keep it short


def _demo(capsys, *argv) -> tuple[int, str, str]:
    code = demo.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def voice_dir() -> Path:
    """The demo voice the installed plugins offer (the Piper voice)."""
    with Runtime() as rt:
        return demo.demo_voice(rt)


@pytest.fixture(scope="module")
def clip(voice_dir, tmp_path_factory) -> tuple[Path, str]:
    """A reference clip and its transcript: the demo voice speaking a sentence."""
    path, text = tmp_path_factory.mktemp("clip") / "clip.wav", "Hello there, this is a short clip."
    assert demo.main([str(voice_dir), "--device", "cpu", "--text", text], out=path) == 0
    return path, text


def _check_wrote(out: str, wav: Path, model_dir: Path, engine: str, mode: str) -> None:
    last = out.splitlines()[-1]
    assert last.startswith(f"demo: wrote {wav.resolve()} (") and f" with {model_dir}: engine {engine}" in last
    assert f", mode {mode}, voice: " in last
    info = soundfile.info(wav)
    assert info.frames > 0 and info.samplerate > 0


def test_the_demo_voice_by_default(tmp_path, capsys, voice_dir):
    engine, presets, _ = _facts(voice_dir)
    wav = tmp_path / "demo.wav"
    code, out, err = _demo(capsys, "-o", wav)
    assert (code, err) == (0, "")
    with Runtime() as rt:  # the default voice is shown by its short id (Piper: the voice's name), not its folder
        short = rt.registry.model_name(voice_dir)
    assert short == "en_US-joe-medium"
    _check_wrote(out, wav, short, engine, "preset")
    assert out.rstrip().endswith(f"voice: its preset voice {presets[0]}")
    code, out, err = _demo(capsys, short, "-o", tmp_path / "by-id.wav")  # MODEL=en_US-joe-medium
    assert code == 0, err
    _check_wrote(out, tmp_path / "by-id.wav", short, engine, "preset")
    info = soundfile.info(wav)
    assert info.frames > info.samplerate  # a real voice: the sentence lasts more than a second


@pytest.mark.parametrize("model_dir", MODEL_DIRS, ids=_id)
def test_a_model_dir_without_a_reference(tmp_path, capsys, model_dir):
    """A preset voice where the model has one; otherwise a clone of a reference the demo makes, saying so."""
    engine, presets, modes = _facts(model_dir)
    wav = tmp_path / "out.wav"
    code, out, err = _demo(capsys, model_dir, "-o", wav, "--text", SHORT)
    assert (code, err) == (0, ""), err
    if presets:
        _check_wrote(out, wav, model_dir, engine, "preset" if "preset" in modes else "instruct")
        assert out.rstrip().endswith(f"voice: its preset voice {presets[0]}")
    else:
        made = tmp_path / "out-reference.wav"
        assert out.startswith(f"demo: {model_dir} has no preset voice, so the demo made a reference to clone: "
                              f"{demo.REFERENCE_TEXT!r} spoken by the ")
        assert f"in {made.resolve()}" in out.splitlines()[0] and soundfile.info(made).frames > 0
        _check_wrote(out, wav, model_dir, engine, "clone")
        assert out.rstrip().endswith("voice: a clone of the demo's reference out-reference.wav")


@pytest.mark.parametrize("with_text", [True, False], ids=["ref-and-text", "ref-only"])
@pytest.mark.parametrize("model_dir", ASSEMBLED, ids=_id)
def test_a_model_dir_with_a_reference(tmp_path, capsys, clip, model_dir, with_text):
    engine, _, modes = _facts(model_dir)
    mode = "clone" if with_text else "cross_lingual"
    ref_args = ["--ref-audio", clip[0], *(["--ref-text", clip[1]] if with_text else [])]
    wav = tmp_path / "out.wav"
    code, out, err = _demo(capsys, model_dir, *ref_args, "-o", wav, "--text", SHORT)
    if mode in modes:
        assert (code, err) == (0, "")
        _check_wrote(out, wav, model_dir, engine, mode)
        assert out.rstrip().endswith(f"voice: a clone of {clip[0]}")
    else:  # e.g. a v1 SFT model, which speaks only with its speakers
        assert (code, out) == (1, "") and err.count("\n") == 1 and "to fix: " in err
        assert f"does not support mode {mode!r}" in err and not wav.exists()


def test_a_voice_that_cannot_clone_says_how_to_run_without_the_reference(tmp_path, capsys, voice_dir, clip):
    _, _, modes = _facts(voice_dir)
    code, out, err = _demo(capsys, voice_dir, "--ref-audio", clip[0], "--ref-text", clip[1], "-o",
                           tmp_path / "x.wav", "--as-make")
    if "clone" in modes:
        assert code == 0
    else:
        assert (code, out) == (1, "")
        assert err == (f"demo: error: {voice_dir} does not support mode 'clone'; it supports:"
                       f" {', '.join(sorted(modes))}; to fix: make demo MODEL={voice_dir}\n")


@pytest.mark.parametrize("argv,message,fix", [
    (["{tmp}/nowhere"], "model directory not found: {tmp}/nowhere",
     "download a model (README: 'Get a model directory'), then run make demo MODEL=path/to/model"),
    (["{tmp}"], "no engine recognises {tmp} (checked: ", "point it at the folder that holds the model's own files"),
    (["{tmp}", "--ref-text", "hi"], "a reference transcript needs its clip",
     "make demo MODEL={tmp} REF=clip.wav REF_TEXT='what the clip says'"),
    (["{tmp}", "--ref-audio", "{tmp}/missing.wav"], "reference audio: audio file not found: {tmp}/missing.wav",
     "make demo MODEL={tmp} REF=path/to/existing-clip.wav REF_TEXT='what the clip says'"),
    (["{tmp}", "--option", "colour=red"], "unknown option 'colour'", "leave the option out: make demo MODEL={tmp}"),
])
def test_mistakes_are_one_line_with_the_fixing_command(tmp_path, capsys, argv, message, fix):
    code, out, err = _demo(capsys, *(a.format(tmp=tmp_path) for a in argv), "--as-make", "-o", tmp_path / "x.wav")
    assert (code, out) == (1, "") and err.count("\n") == 1
    assert err.startswith(f"demo: error: {message.format(tmp=tmp_path)}")
    assert fix.format(tmp=tmp_path) in err and not (tmp_path / "x.wav").exists()


def test_fixes_are_spelled_as_the_demo_was_run(tmp_path, capsys):
    code, out, err = _demo(capsys, tmp_path / "nowhere", "-o", tmp_path / "x.wav")
    assert code == 1 and err.endswith("then run python -m mizuoto.demo path/to/model\n")


def test_no_traceback_without_debug(tmp_path):
    argv = [sys.executable, "-m", "mizuoto.demo", str(tmp_path / "nowhere"), "-o", str(tmp_path / "x.wav")]
    r = subprocess.run(argv, capture_output=True, text=True, cwd=_REPO)
    assert r.returncode == 1 and r.stdout == "" and r.stderr.count("\n") == 1
    assert r.stderr.startswith("demo: error: model directory not found")
    r = subprocess.run([*argv, "--debug"], capture_output=True, text=True, cwd=_REPO)
    assert r.returncode == 1 and "Traceback" in r.stderr and "DemoError" in r.stderr


def test_the_demo_and_the_cli_import_nothing_from_the_testing_package():
    files = [_REPO / "mizuoto" / "demo.py", *sorted((_REPO / "mizuoto" / "cli").glob("*.py"))]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n == "mizuoto.testing" or n.startswith("mizuoto.testing.") for n in names), path

"""Model ids: `org/name` resolved through huggingface_hub from a cache laid out in the hub's own layout, offline."""

import subprocess
import sys

import pytest
import soundfile

from mizuoto.errors import ModelLoadError
from mizuoto.runtime.api import Runtime
from mizuoto.runtime.hub import is_repo_id, resolve_model
from mizuoto.testing.toy import ToneEngine, write_model

REV = "0123456789abcdef0123456789abcdef01234567"


def lay_hub_cache(cache, repo: str = "tone-org/tone-small", revision: str = REV):
    """A hub cache with one model repo: models--org--name/{refs/main, snapshots/<rev>/...} (files, as a download)."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    snapshot = write_model(folder / "snapshots" / revision)
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(revision)
    (folder / "blobs").mkdir()
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """The cache folder, as huggingface_hub sees it in this process and in child processes; offline."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_repo_id_resolves_to_the_snapshot(hub_cache):
    """`org/name` and `org/name@rev` give the snapshot folder; the model loads under the repo id's name."""
    snapshot = lay_hub_cache(hub_cache)
    assert resolve_model("tone-org/tone-small") == snapshot
    assert resolve_model(f"tone-org/tone-small@{REV}") == snapshot
    with Runtime(engines=(ToneEngine,), plugins=False, voices=False) as rt:
        assert [e for e, _ in rt.detect("tone-org/tone-small")] == ["tone"]
        name = rt.load("tone-org/tone-small")
        assert name == "tone-org/tone-small" and rt.info(name).path == snapshot
        assert next(iter(rt.synthesize(name, "ab", voice="low"))).samples.numel() > 0


def test_missing_repo_offline_is_one_clear_line(hub_cache):
    """A repo id absent from the cache, offline: a ModelLoadError naming the cache and how to download it."""
    with pytest.raises(ModelLoadError, match=r"'nobody/nothing' is not in the Hugging Face cache .*HF_HUB_OFFLINE"):
        resolve_model("nobody/nothing")


def test_paths_win_over_ids(tmp_path, monkeypatch):
    """An existing directory spelled like an id is the directory; other specs pass through as paths."""
    monkeypatch.chdir(tmp_path)
    write_model(tmp_path / "org" / "name")
    assert not is_repo_id("org/name") and resolve_model("org/name").resolve() == (tmp_path / "org" / "name")
    assert not is_repo_id("/abs/path") and not is_repo_id("a/b/c") and is_repo_id("FunAudioLLM/CosyVoice2-0.5B")


def test_without_huggingface_hub_names_the_extra(monkeypatch):
    """With huggingface_hub missing, an id is refused naming `pip install 'mizuoto-runtime[hub]'`."""
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(ModelLoadError, match=r"pip install 'mizuoto-runtime\[hub\]'"):
        resolve_model("FunAudioLLM/CosyVoice2-0.5B")


def test_say_and_models_take_a_repo_id(hub_cache, tmp_path):
    """`mizuoto say -m org/name` and `mizuoto models org/name` work from the cache alone (child processes, offline)."""
    lay_hub_cache(hub_cache)
    out = tmp_path / "out.wav"
    r = subprocess.run([sys.executable, "-m", "mizuoto.cli", "say", "abc", "-m", "tone-org/tone-small", "--voice",
                        "low", "-o", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert soundfile.info(str(out)).frames > 0
    r = subprocess.run([sys.executable, "-m", "mizuoto.cli", "models", "tone-org/tone-small"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "tone-org/tone-small: tone" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-m", "mizuoto.cli", "say", "abc", "-m", "nobody/nothing", "-o", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "not in the Hugging Face cache" in r.stderr, r.stderr


def test_serve_takes_a_repo_id(hub_cache):
    """`mizuoto serve -m org/name` serves the snapshot under the repo id's name (the parser's catalogue)."""
    from mizuoto.cli.serve import _models

    snapshot = lay_hub_cache(hub_cache)
    assert _models(["tone-org/tone-small"]) == {"tone-org/tone-small": snapshot}
    assert _models(["t=tone-org/tone-small"]) == {"t": snapshot}

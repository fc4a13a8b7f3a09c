"""`mizuoto fetch whisper-vocab`: CosyVoice 1's vocabulary installed on request, sha256-checked, never at run time.

The download itself is replaced here (nothing downloads at test time); the file and archive come
from the shared assets or are built in the test.
"""

from __future__ import annotations

import hashlib
import io
import tarfile

import pytest

from mizuoto.cli import fetch
from mizuoto.cli.main import main
from mizuoto.engines.cosyvoice import plugin, resources
from mizuoto.errors import MizuotoError, ResourceError
from mizuoto.testing.fixtures import asset_path

VOCAB = asset_path("whisper", "multilingual.tiktoken")


@pytest.fixture
def env_dir(tmp_path, monkeypatch):
    """This environment's share/mizuoto, moved to a temporary folder."""
    where = tmp_path / "prefix" / "share" / "mizuoto"
    monkeypatch.setattr(plugin, "environment_data_dir", lambda: where)
    return where


def _archive(member: str, data: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo(member)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_the_pin_is_the_engines_pin():
    pin = fetch.PINNED["whisper-vocab"]
    assert pin.resource == plugin.WHISPER and {pin.file: pin.sha256} == resources.WHISPER_SHA256
    assert hashlib.sha256(VOCAB.read_bytes()).hexdigest() == pin.sha256
    assert pin.url.startswith("https://files.pythonhosted.org/") and pin.url.endswith("openai_whisper-20250625.tar.gz")


def test_the_download_path_installs_the_checked_file(env_dir, monkeypatch, capsys):
    """The pinned archive (here one built to its member path, pinned in its place) is downloaded, checked, unpacked."""
    pin = fetch.PINNED["whisper-vocab"]
    archive = _archive(pin.member, VOCAB.read_bytes())
    monkeypatch.setitem(fetch.PINNED, "whisper-vocab",
                        fetch.Pinned(**{**pin.__dict__, "archive_sha256": hashlib.sha256(archive).hexdigest()}))
    asked = []
    monkeypatch.setattr(fetch, "download", lambda url, say: asked.append(url) or archive)
    assert main(["fetch", "whisper-vocab"]) == 0
    out, err = capsys.readouterr()
    target = env_dir / "whisper" / "multilingual.tiktoken"
    assert asked == [pin.url] and out.strip() == str(target) and "sha256 checked" in err
    assert target.read_bytes() == VOCAB.read_bytes()
    # CosyVoice finds it there, with an empty $MIZUOTO_HOME and whatever else is installed
    assert env_dir / "whisper" in plugin.whisper_asset_dirs()
    assert main(["fetch", "whisper-vocab"]) == 0 and "already installed" in capsys.readouterr().err
    assert len(asked) == 1  # nothing fetched twice


def test_a_wrong_download_installs_nothing(env_dir, monkeypatch, capsys):
    monkeypatch.setattr(fetch, "download", lambda url, say: b"<html>a captive portal</html>")
    assert main(["fetch", "whisper-vocab"]) == 1
    err = capsys.readouterr().err
    assert "neither multilingual.tiktoken nor the pinned archive" in err and "nothing was installed" in err
    assert not (env_dir / "whisper").exists()


def test_from_a_local_copy_and_into_the_home(tmp_path, monkeypatch, env_dir):
    monkeypatch.setenv("MIZUOTO_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(fetch, "download", lambda url, say: pytest.fail("downloaded"))
    target = fetch.fetch("whisper-vocab", str(VOCAB), home=True, progress=lambda line: None)
    assert target == tmp_path / "home" / "whisper" / "multilingual.tiktoken"
    assert resources.whisper_vocab_dir(tmp_path / "model") == target.parent  # $MIZUOTO_HOME comes first
    bad = tmp_path / "other.tiktoken"
    bad.write_bytes(b"IQ== 0\n")
    with pytest.raises(MizuotoError, match="nothing was installed"):
        fetch.fetch("whisper-vocab", str(bad), progress=lambda line: None)


def test_a_missing_vocabulary_names_the_fetch_command(tmp_path, monkeypatch):
    monkeypatch.setenv("MIZUOTO_HOME", str(tmp_path / "empty"))
    monkeypatch.setattr(plugin, "whisper_asset_dirs", lambda: [])
    with pytest.raises(ResourceError, match="not found: run `mizuoto fetch whisper-vocab`"):
        resources.whisper_vocab_dir(tmp_path / "model")


def test_the_network_is_touched_only_by_download(monkeypatch):
    """No other code path of the package opens a URL: the fetch module's download is the one place."""
    from pathlib import Path

    root = Path(fetch.__file__).resolve().parents[1]
    users = [p.relative_to(root.parent) for p in root.rglob("*.py")
             if "urlopen" in p.read_text(encoding="utf-8") and p.name != "fetch.py"]
    assert not users, users

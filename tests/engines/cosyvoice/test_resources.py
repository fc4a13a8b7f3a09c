"""Where CosyVoice finds its shared resources: $MIZUOTO_HOME first, then the installed cosyvoice extra.

The suite runs with an empty $MIZUOTO_HOME (tests/conftest.py), so what is found here is
what a fresh install finds: the packages of the cosyvoice extra and what `mizuoto fetch` installed in
this environment, through the mizuoto_assets hook.
"""

import os
import shutil
import subprocess
import sys

import pytest

from mizuoto.engines.cosyvoice import plugin, resources
from mizuoto.errors import ResourceError
from mizuoto.runtime.api import Runtime
from mizuoto.runtime.plugins import default_registry
from mizuoto.testing.fixtures import asset_path


def test_fresh_install_finds_verified_fsts_in_the_extra(monkeypatch, tmp_path):
    monkeypatch.setenv("MIZUOTO_HOME", str(tmp_path / "empty"))
    offered = default_registry().asset_candidates(plugin.WETEXT)
    assert offered, "no FST folder offered: is the cosyvoice extra (wetext==0.1.0) installed?"
    found = resources.fst_dir()
    assert found == offered[0]
    for name in resources.FST_SHA256:
        assert (found / name).read_bytes() == asset_path("wetext", "fsts", name).read_bytes()


def test_fresh_install_finds_the_whisper_vocabulary_where_make_fetched_it(monkeypatch, tmp_path):
    """make demo / make test run `mizuoto fetch whisper-vocab` (into this environment's share/mizuoto)."""
    monkeypatch.setenv("MIZUOTO_HOME", str(tmp_path / "empty"))
    found = resources.whisper_vocab_dir(tmp_path)
    assert found in default_registry().asset_candidates(plugin.WHISPER)
    assert (found / resources.WHISPER_TIKTOKEN).read_bytes() == \
        asset_path("whisper", resources.WHISPER_TIKTOKEN).read_bytes()


def test_home_comes_first(tmp_path, monkeypatch):
    target = tmp_path / "cosyvoice" / "wetext"
    target.parent.mkdir(parents=True)
    target.symlink_to(asset_path("wetext", "fsts"), target_is_directory=True)
    monkeypatch.setenv("MIZUOTO_HOME", str(tmp_path))
    assert resources.fst_dir() == target


def _tampered_home(tmp_path, name: str):
    """A $MIZUOTO_HOME whose FST set is the pinned one with one byte appended to `name`."""
    home = tmp_path / "home"
    shutil.copytree(asset_path("wetext", "fsts"), home / "cosyvoice" / "wetext")
    path = home / "cosyvoice" / "wetext" / name
    path.chmod(0o644)  # the assets are read-only
    with open(path, "ab") as f:
        f.write(b"\0")
    return home


@pytest.mark.parametrize("name", sorted(resources.FST_SHA256))
def test_tampered_fst_is_refused_by_name(tmp_path, monkeypatch, name):
    monkeypatch.setenv("MIZUOTO_HOME", str(_tampered_home(tmp_path, name)))
    with pytest.raises(ResourceError, match=f"{name} is not the pinned file.*pip install 'mizuoto-runtime\\[cosyvoice\\]'"):
        resources.fst_dir()


def test_tampered_whisper_vocabulary_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("MIZUOTO_HOME", str(tmp_path / "empty"))
    model = tmp_path / "model"
    model.mkdir()
    (model / resources.WHISPER_TIKTOKEN).write_bytes(b"IQ== 0\n")
    with pytest.raises(ResourceError, match="multilingual.tiktoken is not the pinned file"):
        resources.whisper_vocab_dir(model)


def test_missing_fsts_say_where_and_how(tmp_path, monkeypatch):
    monkeypatch.setenv("MIZUOTO_HOME", str(tmp_path))
    monkeypatch.setattr(plugin, "wetext_fst_dirs", lambda: [])
    with pytest.raises(ResourceError, match="cosyvoice/wetext.*not found.*pip install 'mizuoto-runtime\\[cosyvoice\\]'"):
        resources.fst_dir()


def test_other_wetext_versions_are_not_offered(monkeypatch):
    assert plugin.wetext_fst_dirs(), "the cosyvoice extra's wetext is not installed"
    monkeypatch.setattr(plugin.importlib.metadata, "version", lambda name: "0.1.8")
    assert plugin.wetext_fst_dirs() == []
    assert plugin.version_tuple("0.0.9") <= plugin.WETEXT_VERSIONS[1] < plugin.version_tuple("0.1.1")


def test_plugin_imports_without_torch():
    code = "import sys, mizuoto.engines.cosyvoice.plugin; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_missing_resource_fails_the_load(tmp_path, monkeypatch, assembled, variant_dir):
    monkeypatch.setenv("MIZUOTO_HOME", str(tmp_path))
    monkeypatch.setattr(plugin, "wetext_fst_dirs", lambda: [])
    with pytest.raises(ResourceError, match="pip install 'mizuoto-runtime\\[cosyvoice\\]'"):
        Runtime().load(assembled[variant_dir])


def test_serve_reports_a_refused_resource_at_start(tmp_path, assembled):
    name = sorted(resources.FST_SHA256)[0]
    home = _tampered_home(tmp_path, name)
    model_dir = next(iter(assembled.values()))
    env = {**os.environ, "MIZUOTO_HOME": str(home)}
    done = subprocess.run([sys.executable, "-m", "mizuoto.cli.main", "serve", "-m", str(model_dir), "--port", "0"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert f"{name} is not the pinned file" in done.stderr and "pip install 'mizuoto-runtime[cosyvoice]'" in done.stderr

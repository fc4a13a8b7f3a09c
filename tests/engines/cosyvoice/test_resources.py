"""Where CosyVoice finds its shared resources: $MIZUOTO_HOME first, then bundled packages."""

import pytest

from mizuoto.engines.cosyvoice import resources
from mizuoto.errors import ResourceError
from mizuoto.testing.fixtures import asset_path


def test_default_fst_dir_prefers_home(tmp_path, monkeypatch):
    target = tmp_path / "cosyvoice" / "wetext"
    target.parent.mkdir(parents=True)
    target.symlink_to(asset_path("wetext", "fsts"), target_is_directory=True)
    monkeypatch.setenv("MIZUOTO_HOME", str(tmp_path))
    assert resources.default_fst_dir() == target


def test_default_fst_dir_uses_wheel_fsts(tmp_path, monkeypatch):
    monkeypatch.setenv("MIZUOTO_HOME", str(tmp_path / "empty"))
    wheel = asset_path("wetext", "fsts")
    monkeypatch.setattr(resources, "_wheel_fst_dirs", lambda: [wheel])
    assert resources.default_fst_dir() == wheel


def test_default_fst_dir_missing_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("MIZUOTO_HOME", str(tmp_path))
    monkeypatch.setattr(resources, "_wheel_fst_dirs", lambda: [])
    with pytest.raises(ResourceError, match="cosyvoice/wetext.*pip install wetext"):
        resources.default_fst_dir()


def test_wheel_version_range():
    assert resources._version_tuple("0.0.9") <= (0, 1, 0)
    assert resources._version_tuple("0.1.8") > (0, 1, 0)

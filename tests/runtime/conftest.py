"""A tone-engine model directory for the runtime tests."""

import pytest

from mizuoto.testing.toy import write_model


@pytest.fixture
def tone_dir(tmp_path):
    """A fresh sine-tone model directory."""
    return write_model(tmp_path / "tone")

"""Suite-wide setup: fixtures must exist, threads are pinned, and $MIZUOTO_HOME starts empty.

Shared resources (the wetext FSTs, Whisper's vocabulary) come from the packages of the
`cosyvoice` extra through the `mizuoto_assets` hook, exactly as on a user's fresh install:
nothing is laid into the home by hand.
"""

import atexit
import os
import shutil
import tempfile

import pytest
import torch

from mizuoto.testing.fixtures import fixtures_root
from mizuoto.testing.toy import write_model

# Fixtures were recorded with 2 threads; float reductions can depend on the thread count. Child
# processes (servers, fresh-process tests) take the same count through the runtime's setting.
torch.set_num_threads(2)
os.environ["MIZUOTO_THREADS"] = "2"
fixtures_root()  # raises at collection if the fixture tree is missing

# A private, empty $MIZUOTO_HOME: caches land there, and no resource hides a missing install.
# Removed when the session's process ends (child processes the tests start are done by then).
os.environ["MIZUOTO_HOME"] = tempfile.mkdtemp(prefix="mizuoto-home-")
atexit.register(shutil.rmtree, os.environ["MIZUOTO_HOME"], ignore_errors=True)


@pytest.fixture(autouse=True)
def _own_voice_store(tmp_path_factory, monkeypatch):
    """Each test's Runtimes (and its child processes) store cached voices in a folder of their own.

    Voices persist by design; across tests they would leak (an id stored by one test would be
    restored into the next test's model of the same files).
    """
    monkeypatch.setenv("MIZUOTO_VOICE_STORE", str(tmp_path_factory.mktemp("voices")))


@pytest.fixture
def tone_dir(tmp_path):
    """A fresh sine-tone model directory (the toy engine of mizuoto.testing.toy)."""
    return write_model(tmp_path / "tone")


def pytest_terminal_summary(terminalreporter):
    """Name this CPU and the full-pipeline recording it was compared with (fixtures, a per-CPU one, none)."""
    from mizuoto.testing.cpu_recordings import recording_for_this_cpu

    terminalreporter.write_line(recording_for_this_cpu().describe())

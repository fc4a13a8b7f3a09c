"""The engine contract suite over every registered engine, with models found in the fixture tree.

The sine-tone engine and the toy batched LM (both registered by the tests/plugins/toy entry point) get a
model written here (tests/testing/test_toy_lm.py runs the suite on the toy LM batched too);
engines with upstream-format fixtures (e.g. cosyvoice) are matched to fixture dirs by their detect.
"""

import atexit
import shutil
import tempfile
from pathlib import Path

from mizuoto.runtime.plugins import Registry
from mizuoto.testing.contract import *  # noqa: F401,F403  (the tests and their parametrization)
from mizuoto.testing.fixtures import fixtures_root
from mizuoto.testing.toy import write_model
from mizuoto.testing.toy_lm import write_model as write_toy_lm

_TMP = Path(tempfile.mkdtemp(prefix="mizuoto-contract-"))
atexit.register(shutil.rmtree, _TMP, ignore_errors=True)


# the model dirs the repository's plugins record their own fixtures in (e.g. mizuoto-chatterbox's)
PLUGIN_MODELS = Path(__file__).resolve().parents[2] / "plugins"


def CONTRACT_MODELS():
    """A fresh tone model and toy LM, the plugins' example models (mizuoto-piper's voice), every fixture directory up to
    three levels deep and the repository's plugins' fixture models (engines' detect decides)."""
    root = fixtures_root()
    dirs = [p for p in root.glob("*/*/*") if p.is_dir()] + [p for p in root.glob("*/*") if p.is_dir()]
    dirs += [p for p in PLUGIN_MODELS.glob("*/tests/fixtures/models/*") if p.is_dir()]
    examples = Registry().example_models()
    assert examples, "no plugin offers an example model (mizuoto-piper's default voice is expected)"
    # a parent of a fixed name: the case id (parent/name) is the same in every process (pytest-xdist workers)
    return [write_model(_TMP / "toy" / "tone"), write_toy_lm(_TMP / "toy" / "toylm"), *examples] + sorted(dirs)

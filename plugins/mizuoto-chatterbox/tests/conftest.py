"""The Chatterbox cases recorded from upstream (fixtures/README.md), found by walking the tree.

`$MIZUOTO_CHATTERBOX_FIXTURES` points at another tree of the same layout (default: fixtures/ here).
"""

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from safetensors.torch import load_file

ROOT = Path(os.environ.get("MIZUOTO_CHATTERBOX_FIXTURES", Path(__file__).parent / "fixtures"))


@dataclass(frozen=True)
class Case:
    """One recorded `generate` call: its case.json and its tensors."""

    name: str
    spec: dict
    path: Path

    @property
    def model_dir(self) -> Path:
        return ROOT / self.spec["model_dir"]

    @property
    def clip(self) -> Path | None:
        """The reference clip of a clone case (None for a preset)."""
        clip = self.spec.get("reference_clip")
        return ROOT / clip if clip else None

    def tensors(self) -> dict:
        return load_file(str(self.path / "record.safetensors"))

    def model_file(self, names: dict) -> Path:
        """The one file of `names` (`weights.T3_FILES`, `S3GEN_FILES`) in the case's model dir."""
        from mizuoto_chatterbox.weights import one_of

        return one_of(self.model_dir, names)

    def t3(self):
        """The case's T3, loaded once per model dir."""
        from mizuoto_chatterbox.t3 import load_t3
        from mizuoto_chatterbox.weights import T3_FILES

        return _cached(load_t3, self.model_file(T3_FILES))

    def t3_options(self):
        """The generate kwargs T3 reads."""
        from mizuoto_chatterbox.t3 import T3Options

        kw = self.spec["generate_kwargs"]
        return T3Options(**{k: kw[k] for k in ("temperature", "top_p", "min_p", "top_k", "repetition_penalty",
                                                "cfg_weight") if k in kw})


@functools.lru_cache(maxsize=None)
def _cached(load, path: Path):
    return load(path)


def cases() -> list[Case]:
    """Every case under cases/ (a missing or empty tree fails collection)."""
    found = sorted(ROOT.glob("cases/*/case.json"))
    if not found:
        raise FileNotFoundError(f"no Chatterbox cases under {ROOT}/cases (set MIZUOTO_CHATTERBOX_FIXTURES)")
    return [Case(p.parent.name, json.loads(p.read_text(encoding="utf-8")), p.parent) for p in found]


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        found = cases()
        metafunc.parametrize("case", found, ids=[c.name for c in found])


@pytest.fixture(autouse=True)
def _threads():
    import torch

    torch.set_num_threads(int(os.environ.get("MIZUOTO_TEST_THREADS", "2")))

"""The Qwen3-TTS cases recorded from upstream (fixtures/README.md), found by walking the tree.

`$MIZUOTO_QWEN3TTS_FIXTURES` points at another tree of the same layout (default: fixtures/ here);
a missing tree, or one without cases, fails loudly. Upstream's float results depend on the CPU
class (`mizuoto.testing.cpu_recordings`): the tree's own recording holds for the classes its
`cpu.json` names, re-recordings for other classes sit in `<tree>/cpu/<folder>/cases/<case>/`. A
case is compared with the record of this machine's class (`Case.cpu`, `Case.tensors`):
torch.equal where one exists, else integers equal and floats within upstream's measured spread.
"""

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from safetensors.torch import load_file

DEFAULT_ROOT = Path(__file__).parent / "fixtures"
ROOT = Path(os.environ.get("MIZUOTO_QWEN3TTS_FIXTURES", DEFAULT_ROOT))
RECORD = "record.safetensors"
# upstream's generate_* arguments that are a request's own fields, not options
CALL_FIELDS = {"text", "ref_audio", "ref_text", "x_vector_only_mode", "speaker", "instruct"}


@functools.cache
def tree():
    """The tree and its per-class re-recordings."""
    from mizuoto.testing.cpu_recordings import RecordTree

    return RecordTree(ROOT, RECORD, "Qwen3-TTS cases")


@dataclass(frozen=True)
class Case:
    """One recorded call: its case.json and its tensors."""

    name: str
    spec: dict
    path: Path

    @property
    def model_dir(self) -> Path:
        return ROOT / self.spec["model_dir"]

    @property
    def kwargs(self) -> dict:
        """The call's keyword arguments (paths relative to the tree)."""
        return dict(self.spec["kwargs"])

    @property
    def cpu(self):
        """How this case is compared on this machine's CPU class (`cpu_recordings.Comparison`)."""
        return tree().comparison(self.name)

    def request(self, declared: set) -> dict:
        """The recorded call as `Runtime.synthesize` keywords: the text, the voice (a reference clip with or without
        its transcript, a preset speaker, or VoiceDesign's one voice), the instruction, the seed, and every other
        argument as the request option of its name (`declared`: the model's); one that is neither fails."""
        from mizuoto.runtime.engine import Reference
        from mizuoto_qwen3tts.engine import DESIGN_VOICE

        kw = self.kwargs
        unknown = set(kw) - CALL_FIELDS - declared
        assert not unknown, f"upstream's arguments {sorted(unknown)} are neither request fields nor options"
        options = {k: (v.lower() if k == "language" else v) for k, v in kw.items() if k in declared}
        request = {"text": kw["text"], "seed": self.spec["seed"], "options": options}
        if self.spec["method"] == "generate_voice_clone":
            in_context = not kw.get("x_vector_only_mode", False)
            request |= {"voice": Reference(str(ROOT / kw["ref_audio"]), kw["ref_text"] if in_context else None),
                        "mode": "clone" if in_context else "cross_lingual"}
        elif self.spec["method"] == "generate_custom_voice":
            request |= {"voice": kw["speaker"].lower()}
            if kw.get("instruct"):
                request |= {"instruct": kw["instruct"], "mode": "instruct"}
        else:
            request |= {"voice": DESIGN_VOICE, "instruct": kw["instruct"], "mode": "instruct"}
        return request

    def tensors(self) -> dict:
        """The case's recorded tensors: this CPU class's record where the tree has one."""
        return load_file(str(tree().record_path(self.name)))


def cases() -> list[Case]:
    """Every case of the tree, by name."""
    if not ROOT.is_dir():
        raise FileNotFoundError(f"Qwen3-TTS fixture tree not found: {ROOT} (set MIZUOTO_QWEN3TTS_FIXTURES)")
    found = []
    for spec_path in sorted(ROOT.glob("cases/*/case.json")):
        if not (spec_path.parent / RECORD).is_file():
            raise FileNotFoundError(f"{spec_path.parent} has case.json but no {RECORD}")
        found.append(Case(spec_path.parent.name, json.loads(spec_path.read_text(encoding="utf-8")), spec_path.parent))
    if not found:
        raise FileNotFoundError(f"no Qwen3-TTS cases under {ROOT / 'cases'} (set MIZUOTO_QWEN3TTS_FIXTURES)")
    return found


def pytest_generate_tests(metafunc):
    # the contract suite's modules parametrize their own `case` (a model dir of an engine)
    if "case" in metafunc.fixturenames and not hasattr(metafunc.module, "CONTRACT_MODELS"):
        found = cases()
        metafunc.parametrize("case", found, ids=[c.name for c in found])


@pytest.fixture(autouse=True)
def _threads():
    import torch

    torch.set_num_threads(int(os.environ.get("MIZUOTO_TEST_THREADS", "2")))


def pytest_terminal_summary(terminalreporter):
    """Name this CPU's class and what the Qwen3-TTS cases were compared with."""
    terminalreporter.write_line(tree().describe([c.name for c in cases()]))


@pytest.fixture
def any_case() -> Case:
    """One case of the tree (its model dir is what a test derives a broken copy from)."""
    return cases()[0]

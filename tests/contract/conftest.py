"""Complete CosyVoice directories for the contract suite.

The fixture model dirs of CosyVoice hold only the yaml and llm/flow/hift: a user's directory
also has the front-end ONNX files and tokenizer files. Each is assembled here (symlinks to the
fixture files) and handed to the suite through $MIZUOTO_CONTRACT_MODELS, so every variant is
checked as a user would load it. test_contract.py also offers the bare fixture dirs (the
engine detects them by their yaml, and correctly refuses to load a v2/v3 one: it can serve no
mode); those cases are deselected, their assembled copies replace them, and only where the
assembled copy's same test was collected (else collection stops with the reason): a copy that
stopped being detected must not take its bare dir's tests away with it unnoticed.

Streaming text in gets, per model, the input of a full-pipeline fixture case that streamed its
text on that model (`full/*/cases`, raw_inputs.tts_pieces), with the case's LM modification
applied to the copy's llm.pt: upstream spoke on exactly that input, so the check is real.
"""

import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from mizuoto.testing.contract import ENV_MODELS, ENV_STREAM_TEXT, Case
from mizuoto.testing.cosyvoice_cases import assemble_model_dir
from mizuoto.testing.cosyvoice_full import apply_model_modification, stream_input, streamed_text_cases, tiny_model_dir
from mizuoto.testing.fixtures import fixtures_root

_HERE = Path(__file__).resolve().parent
_BARE = sorted(p for p in fixtures_root().glob("cosyvoice/*/model") if p.is_dir())
_TMP = Path(tempfile.mkdtemp(prefix="mizuoto-contract-cosyvoice-"))
atexit.register(shutil.rmtree, _TMP, ignore_errors=True)
ASSEMBLED = [assemble_model_dir(d, _TMP / f"assembled-{d.parent.name}" / "model") for d in _BARE]
os.environ[ENV_MODELS] = os.pathsep.join(
    [p for p in os.environ.get(ENV_MODELS, "").split(os.pathsep) if p] + [str(p) for p in ASSEMBLED])


def _stream_inputs() -> dict[str, dict]:
    """Assembled model dir -> the streamed-text input of a full case recorded on its fixture model."""
    inputs: dict[str, dict] = {}
    for meta in streamed_text_cases():
        if not any(seg.get("lm_tokens_raw_len") for seg in meta["segments"]):
            continue  # upstream's LM said nothing for it: no audio to check the contract on
        source = tiny_model_dir(meta)
        for bare, assembled in zip(_BARE, ASSEMBLED):
            if source is None or bare.resolve() != source.resolve() or str(assembled) in inputs:
                continue
            if meta.get("model_modification"):
                llm = assembled / "llm.pt"
                original = llm.resolve()
                llm.unlink()
                apply_model_modification(meta["model_modification"], original, llm)
            inputs[str(assembled)] = stream_input(meta)
    return inputs


_STREAM_FILE = _TMP / "stream-text.json"
_STREAM_FILE.write_text(json.dumps(_stream_inputs()), encoding="utf-8")
os.environ[ENV_STREAM_TEXT] = str(_STREAM_FILE)


def _case_dir(item) -> Path | None:
    """The model dir of a contract-suite item of this folder (this hook sees every item of the session)."""
    if Path(item.path).parent != _HERE or not hasattr(item, "callspec"):
        return None
    case = item.callspec.params.get("case")
    return Path(case.model_dir) if isinstance(case, Case) else None


def pytest_collection_modifyitems(config, items):
    bare = {d.resolve(): a for d, a in zip(_BARE, ASSEMBLED)}
    keep, dropped = [], []
    for item in items:
        model_dir = _case_dir(item)
        if model_dir is not None and model_dir.resolve() in bare:
            dropped.append(item)
            continue
        keep.append(item)
    # a bare dir's items go only where its assembled copy's same test runs in their place
    kept = {(item.originalname, _case_dir(item)) for item in keep}
    lost = sorted({str(bare[_case_dir(item).resolve()]) for item in dropped
                   if (item.originalname, bare[_case_dir(item).resolve()]) not in kept})
    if lost:
        raise pytest.UsageError(f"the contract suite has no (or not every) item for {', '.join(lost)} (not "
                                "detected?), so the bare fixture dirs they replace cannot be deselected")
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep

"""Per-CPU recordings: the right one is picked for a CPU, applied by name, and compared as documented."""

import json

import pytest
import torch
from safetensors.torch import save_file

from mizuoto.testing.cosyvoice_full import list_full_cases, load_full_case
from mizuoto.testing.cpu_recordings import (CPU_DEPENDENT, CROSS_CPU_ATOL, Cpu, parse_cpu, recording_for,
                                            recording_for_this_cpu, this_cpu)
from mizuoto.testing.fixtures import fixtures_root, load_tensors

ZEN = "AMD EPYC (avx512f avx512dq avx512_bf16 avx512_vnni)"


def _cpu(text: str, vendor: str) -> Cpu:
    model, flags = parse_cpu(text)
    return Cpu(model, vendor, flags)


@pytest.fixture
def tree(tmp_path):
    """A `full/` folder with one per-CPU recording of one case (its chunk differs there)."""
    cases = tmp_path / "cpu" / "some-amd" / "v9" / "cases"
    cases.mkdir(parents=True)
    save_file({"seg.0.chunk.0": torch.full((4,), 2.0)}, str(cases / "c.safetensors"))
    (cases / "c.json").write_text(json.dumps({
        "case": "c", "version": "v9", "cpu": ZEN, "differs": ["seg.0.chunk.0"], "sha256_tts_speech_f32": "amd",
        "max_abs_diff": {"seg.0.chunk.0": 3e-7}}))
    return tmp_path


def test_cpuinfo_gives_model_vendor_and_only_the_avx512_amx_flags(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\n"
                    "flags\t\t: fpu sse avx2 avx512f avx512_vnni amx_tile\n\nprocessor\t: 1\nmodel name\t: other\n")
    this_cpu.cache_clear()
    try:
        cpu = this_cpu(str(info))
    finally:
        this_cpu.cache_clear()
    assert cpu == Cpu("AMD EPYC", "AuthenticAMD", frozenset({"avx512f", "avx512_vnni", "amx_tile"}))
    assert parse_cpu(ZEN) == ("AMD EPYC", frozenset({"avx512f", "avx512dq", "avx512_bf16", "avx512_vnni"}))


def test_the_recording_of_the_same_cpu_is_chosen_and_applied(tree):
    rec = recording_for(tree, _cpu(ZEN, "AuthenticAMD"))
    assert rec.exact and rec.folder == tree / "cpu" / "some-amd" and rec.atol == 3e-7
    meta = {"sha256_tts_speech_f32": "intel"}
    tensors = {"seg.0.chunk.0": torch.zeros(4), "seg.0.flow.0.mel": torch.ones(2)}
    rec.apply("v9", "c", meta, tensors)
    assert meta["sha256_tts_speech_f32"] == "amd" and torch.equal(tensors["seg.0.chunk.0"], torch.full((4,), 2.0))
    assert torch.equal(tensors["seg.0.flow.0.mel"], torch.ones(2))
    rec.apply("v9", "other", meta, tensors)  # a case with no file was reproduced bit for bit
    assert meta["sha256_tts_speech_f32"] == "amd"
    assert "amd" in rec.describe() and "torch.equal" in rec.describe()


@pytest.mark.parametrize("text, vendor, exact", [
    ("AMD EPYC (avx512f avx512dq)", "AuthenticAMD", False),  # other flags: another CPU
    ("AMD Ryzen (avx512f avx512dq avx512_bf16 avx512_vnni)", "AuthenticAMD", False),
    ("Intel(R) Xeon(R) (avx512f)", "GenuineIntel", True),  # the fixtures' own recording
])
def test_other_cpus_take_the_fixtures_or_no_recording(tree, text, vendor, exact):
    rec = recording_for(tree, _cpu(text, vendor))
    assert rec.folder is None and rec.exact is exact
    meta, tensors = {"sha256_tts_speech_f32": "intel"}, {"seg.0.chunk.0": torch.zeros(4)}
    rec.apply("v9", "c", meta, tensors)
    assert meta["sha256_tts_speech_f32"] == "intel" and torch.equal(tensors["seg.0.chunk.0"], torch.zeros(4))
    assert ("NOT checkable" in rec.describe()) is not exact


def test_without_a_recording_only_cpu_dependent_tensors_get_the_bound(tree):
    rec = recording_for(tree, _cpu("Some CPU", "Other"))
    base = torch.linspace(-1, 1, 64)
    close, far = base + rec.atol / 2, base.clone()
    far[3] += 2 * rec.atol
    rec.assert_equal(close, base, "seg.1.hift.0.speech", "speech")
    rec.assert_equal(close, base, "seg.0.chunk.2", "chunk")
    with pytest.raises(AssertionError, match="max abs diff"):
        rec.assert_equal(far, base, "output.tts_speech", "output")
    with pytest.raises(AssertionError):
        rec.assert_equal(close, base, "seg.0.flow.0.mel", "mel")  # not CPU-dependent: torch.equal
    exact = recording_for(tree, _cpu(ZEN, "AuthenticAMD"))
    with pytest.raises(AssertionError):
        exact.assert_equal(close, base, "seg.0.chunk.0", "chunk")


def test_a_recording_may_only_differ_where_the_faithfulness_rule_allows(tree):
    path = tree / "cpu" / "some-amd" / "v9" / "cases" / "c.json"
    meta = json.loads(path.read_text())
    save_file({"seg.0.chunk.0": torch.zeros(4), "seg.0.flow.0.mel": torch.zeros(2)}, str(path.with_suffix(".safetensors")))
    path.write_text(json.dumps({**meta, "differs": ["seg.0.chunk.0", "seg.0.flow.0.mel"]}))
    with pytest.raises(AssertionError, match="faithfulness"):
        recording_for(tree, _cpu(ZEN, "AuthenticAMD")).apply("v9", "c", {}, {})


def test_the_trees_recordings_apply_to_its_cases():
    """Each per-CPU file of the fixture tree names a case that exists, CPU-dependent tensors that the
    case records (aliases resolved), and values of the recorded shape and dtype."""
    full = fixtures_root() / "full"
    cases = {(p.parent.parent.name, p.stem): p for p in list_full_cases()}
    for path in sorted((full / "cpu").glob("*/*/cases/*.json")):
        meta = json.loads(path.read_text(encoding="utf-8"))
        case = cases[path.parent.parent.name, path.stem]
        intel = load_tensors(case, json.loads(case.read_text(encoding="utf-8")))
        for name in meta["differs"]:
            assert CPU_DEPENDENT.fullmatch(name), (path, name)
        values = load_tensors(path, {"tensor_file": path.with_suffix(".safetensors").name})
        for name in meta["differs"]:
            assert values[name].shape == intel[name].shape and values[name].dtype == intel[name].dtype
            assert not torch.equal(values[name], intel[name]), f"{path}: {name} is listed but equal"
    rec = recording_for_this_cpu()
    assert rec.atol >= CROSS_CPU_ATOL
    if rec.folder is not None:  # on a recorded CPU the loaded cases carry its values
        for (version, name), path in cases.items():
            found = rec.overlay(version, name)
            if found:
                assert load_full_case(path).meta["sha256_tts_speech_f32"] == found["sha256_tts_speech_f32"]

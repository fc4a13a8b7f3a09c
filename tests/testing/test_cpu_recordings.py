"""Per-CPU-class recordings: a class is read from /proc/cpuinfo, its recording picked, applied and compared as documented."""

import json

import pytest
import torch
from safetensors.torch import save_file

from mizuoto.testing.cosyvoice_full import list_full_cases, load_full_case
from mizuoto.testing.cpu_recordings import (CpuClass, class_of_cpuinfo, class_of_recorded_cpu, folder_class, kind,
                                            measured_bounds, recording_for, recording_for_this_cpu, this_class)
from mizuoto.testing.fixtures import fixtures_root, load_tensors

ZEN4 = "AMD EPYC (avx512f avx512dq avx512ifma avx512cd avx512bw avx512vl avx512_bf16 avx512_vnni)"
# /proc/cpuinfo of the three classes met so far (first processor; flags cut to what matters and some noise)
CPUINFO = {
    "intel-amx": ("GenuineIntel", "Intel(R) Xeon(R) Processor", "6", "143",
                  "fpu sse4_2 avx avx2 fma avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16 avx512_fp16 "
                  "amx_bf16 amx_tile amx_int8"),
    "amd-avx512": ("AuthenticAMD", "AMD EPYC", "25", "17",
                   "fpu sse4_2 avx avx2 fma avx512f avx512dq avx512ifma avx512cd avx512bw avx512vl avx512_bf16 "
                   "avx512_vnni"),
    "amd-avx2": ("AuthenticAMD", "AMD EPYC", "23", "1", "fpu sse4_2 avx avx2 fma f16c bmi2 sha_ni"),
}


def _cpuinfo(vendor: str, model: str, family: str, number: str, flags: str) -> str:
    first = (f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: {number}\n"
             f"model name\t: {model}\nflags\t\t: {flags}\n")
    return first + "\nprocessor\t: 1\nvendor_id\t: Other\nflags\t\t: avx512f amx_tile\n"


@pytest.fixture
def tree(tmp_path):
    """A `full/` folder with a Zen 4 and an AVX2 recording of one case (its chunk, the AVX2 one also its mel).

    The case's own values have a largest magnitude of 1, so each relative bound equals the absolute one.
    """
    own = tmp_path / "v9" / "cases"
    own.mkdir(parents=True)
    save_file({n: torch.ones(4) for n in ("seg.0.chunk.0", "seg.1.chunk.0", "seg.0.flow.0.mel")}, str(own / "c.safetensors"))
    (own / "c.json").write_text(json.dumps({"case": "c", "tensor_file": "c.safetensors"}))
    for folder, cpu, differs in (("some-amd", ZEN4, {"seg.0.chunk.0": 3e-7, "seg.1.chunk.0": 1e-7}),
                                 ("amd-epyc-avx2", "AMD EPYC", {"seg.0.chunk.0": 1e-7, "seg.0.flow.0.mel": 5e-6})):
        cases = tmp_path / "cpu" / folder / "v9" / "cases"
        cases.mkdir(parents=True)
        save_file({name: torch.full((4,), 2.0) for name in differs}, str(cases / "c.safetensors"))
        (cases / "c.json").write_text(json.dumps({
            "case": "c", "version": "v9", "cpu": cpu, "differs": sorted(differs),
            "sha256_tts_speech_f32": folder, "max_abs_diff": differs}))
    return tmp_path


@pytest.mark.parametrize("name", sorted(CPUINFO))
def test_each_cpuinfo_gives_its_class_and_recording(tree, name):
    """Fed the /proc/cpuinfo of each class, the class and then the recording it compares with follow."""
    cpu = class_of_cpuinfo(_cpuinfo(*CPUINFO[name]), capability="AVX512" if "avx512" in CPUINFO[name][4] else "AVX2")
    assert cpu == CpuClass.parse(name)
    rec = recording_for(tree, cpu)
    expected = {"intel-amx": (None, True), "amd-avx512": ("some-amd", True), "amd-avx2": ("amd-epyc-avx2", True)}
    assert (rec.folder.name if rec.folder else None, rec.exact) == expected[name]
    assert str(cpu) in rec.describe()


def test_torch_and_the_libraries_isa_caps_narrow_the_class():
    text = _cpuinfo(*CPUINFO["intel-amx"])
    assert class_of_cpuinfo(text, "AVX512").isa == "amx"  # torch's capability names no AMX
    assert class_of_cpuinfo(text, "AVX2").isa == "avx2"  # ATEN_CPU_CAPABILITY=avx2
    assert class_of_cpuinfo(text, "AVX512", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}).isa == "avx512"
    assert class_of_cpuinfo(text, "AVX512", {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}).isa == "avx2"
    assert class_of_cpuinfo(text, "AVX512", {"MKL_CBWR": "AUTO"}).isa == "amx"
    assert class_of_cpuinfo("", "DEFAULT") == CpuClass("other", "baseline")


def test_a_recording_names_its_class_by_field_cpu_or_folder(tmp_path):
    assert class_of_recorded_cpu(ZEN4) == CpuClass("amd", "avx512")
    assert class_of_recorded_cpu("AMD EPYC") == CpuClass("amd", "avx2")  # same model name, another class
    assert class_of_recorded_cpu("Intel(R) Xeon(R) (avx512f avx512bw avx512vl avx512dq amx_tile)").name == "intel-amx"
    assert folder_class(tmp_path / "amd-epyc-avx2") == CpuClass("amd", "avx2")
    assert folder_class(tmp_path / "x", [{"cpu_class": "intel-avx2", "cpu": ZEN4}]) == CpuClass("intel", "avx2")
    with pytest.raises(AssertionError, match="different CPU classes"):
        folder_class(tmp_path / "x", [{"cpu": ZEN4}, {"cpu": "AMD EPYC"}])
    with pytest.raises(AssertionError, match="names no CPU class"):
        folder_class(tmp_path / "some-amd")


def test_the_recording_of_the_class_is_applied(tree):
    rec = recording_for(tree, CpuClass("amd", "avx2"))
    meta = {"sha256_tts_speech_f32": "intel"}
    tensors = {"seg.0.chunk.0": torch.zeros(4), "seg.0.flow.0.mel": torch.ones(4), "seg.0.lm.tokens_raw": torch.ones(2)}
    rec.apply("v9", "c", meta, tensors)
    assert meta["sha256_tts_speech_f32"] == "amd-epyc-avx2"
    assert torch.equal(tensors["seg.0.flow.0.mel"], torch.full((4,), 2.0))
    rec.apply("v9", "other", meta, tensors)  # a case with no file was reproduced bit for bit
    assert meta["sha256_tts_speech_f32"] == "amd-epyc-avx2"
    assert "torch.equal" in rec.describe() and "NOT" not in rec.describe()


def test_unrecorded_classes_compare_floats_within_the_measured_bound_per_kind(tree):
    for cpu in (CpuClass("intel", "avx2"), CpuClass("intel", "avx512"), CpuClass("other", "baseline")):
        rec = recording_for(tree, cpu)
        assert rec.folder is None and not rec.exact and "NOT checkable" in rec.describe()
        assert rec.bounds == {"seg.<i>.chunk.<i>": 3e-7, "seg.<i>.flow.<i>.mel": 5e-6}  # measured, largest per kind
        assert rec.relative == rec.bounds  # the case's largest magnitude is 1
        assert rec.bound("seg.0.flow.0.mel", torch.full((3,), -4.0)) == pytest.approx(2e-5)  # scales with the tensor
        assert "5e-06" in rec.describe()
        base = torch.linspace(-1, 1, 64)
        rec.assert_equal(base + 2e-7, base, "seg.3.chunk.2", "chunk")
        rec.assert_equal(base + 4e-6, base, "seg.0.flow.1.mel", "mel")
        with pytest.raises(AssertionError, match="max abs diff"):
            rec.assert_equal(base + 4e-7, base, "seg.0.chunk.0", "chunk")
        with pytest.raises(AssertionError):
            rec.assert_equal(base + 1e-9, base, "seg.0.input.llm_embedding", "never differed: torch.equal")
        with pytest.raises(AssertionError):  # integers are equal on every CPU
            rec.assert_equal(torch.tensor([1, 3]), torch.tensor([1, 2]), "seg.0.chunk.0", "ids")
    exact = recording_for(tree, CpuClass("amd", "avx512"))
    with pytest.raises(AssertionError):
        exact.assert_equal(base + 1e-9, base, "seg.0.chunk.0", "chunk")


def test_a_trees_cpu_json_names_the_classes_its_own_recording_holds_for(tree):
    assert recording_for(tree, CpuClass("intel", "amx")).exact
    (tree / "cpu.json").write_text(json.dumps({"recorded_on": ["amd-avx2"]}))
    assert not recording_for(tree, CpuClass("intel", "amx")).exact


def test_integer_tensors_never_differ_by_cpu(tree):
    path = tree / "cpu" / "some-amd" / "v9" / "cases" / "c.json"
    meta = json.loads(path.read_text())
    save_file({"seg.0.chunk.0": torch.zeros(4), "seg.0.lm.tokens_raw": torch.zeros(2, dtype=torch.int64)},
              str(path.with_suffix(".safetensors")))
    path.write_text(json.dumps({**meta, "differs": ["seg.0.chunk.0", "seg.0.lm.tokens_raw"]}))
    with pytest.raises(AssertionError, match="integer"):
        recording_for(tree, CpuClass("amd", "avx512")).apply("v9", "c", {}, {})


def test_bounds_of_whole_records_are_measured_per_kind():
    base = {"a.0.mel": torch.full((3,), 4.0), "a.1.mel": torch.ones(2), "ids": torch.tensor([1, 2]), "only": torch.ones(1)}
    other = {"a.0.mel": torch.tensor([4.0, 4 + 2**-17, 4.0]), "a.1.mel": torch.full((2,), 1 - 2**-18),
             "ids": torch.tensor([1, 2])}
    assert measured_bounds(base, other) == {"a.<i>.mel": 2**-17}  # the larger absolute difference
    assert measured_bounds(base, other, relative=True) == {"a.<i>.mel": 2**-18}  # the larger fraction
    assert kind("seg.12.hift.0.speech") == "seg.<i>.hift.<i>.speech" and kind("ve_mel") == "ve_mel"


def test_the_trees_recordings_apply_to_its_cases():
    """Each per-class file of the fixture tree names a case that exists, float tensors that the case
    records (aliases resolved), and values of the recorded shape and dtype that differ."""
    full = fixtures_root() / "full"
    cases = {(p.parent.parent.name, p.stem): p for p in list_full_cases()}
    for path in sorted((full / "cpu").glob("*/*/cases/*.json")):
        meta = json.loads(path.read_text(encoding="utf-8"))
        folder_class(path.parents[2], [meta])  # names its class
        case = cases[path.parent.parent.name, path.stem]
        intel = load_tensors(case, json.loads(case.read_text(encoding="utf-8")))
        values = load_tensors(path, {"tensor_file": path.with_suffix(".safetensors").name})
        for name in meta["differs"]:
            assert intel[name].is_floating_point(), f"{path}: {name} is an integer tensor"
            assert values[name].shape == intel[name].shape and values[name].dtype == intel[name].dtype
            assert not torch.equal(values[name], intel[name]), f"{path}: {name} is listed but equal"
    rec = recording_for_this_cpu()
    print(rec.describe())
    if rec.folder is not None:  # on a recorded class the loaded cases carry its values
        for (version, name), path in cases.items():
            found = rec.overlay(version, name)
            if found:
                assert load_full_case(path).meta["sha256_tts_speech_f32"] == found["sha256_tts_speech_f32"]


def test_this_machine_has_a_class():
    assert this_class().isa in ("baseline", "avx2", "avx512", "amx")


def test_a_log_spectrum_is_compared_as_energies_where_unrecorded(tree):
    """A near-empty band's log may move far; its energy cannot, and a loud band's may not move past the bound."""
    rec = recording_for(tree, CpuClass("intel", "avx2"))
    theirs = torch.tensor([0.0, -20.0])  # energies 1 and 2e-9: the largest is 1
    quiet_moved = torch.tensor([0.0, -19.0])  # its energy moves by 3e-9, its log by 1
    rec.assert_equal(quiet_moved, theirs, "seg.0.flow.0.mel", "quiet band", log=True)
    with pytest.raises(AssertionError):
        rec.assert_equal(quiet_moved, theirs, "seg.0.flow.0.mel", "as logs")
    with pytest.raises(AssertionError, match="max abs diff"):
        rec.assert_equal(torch.tensor([1e-5, -20.0]), theirs, "seg.0.flow.0.mel", "loud band", log=True)
    with pytest.raises(AssertionError):  # where recorded, torch.equal still
        recording_for(tree, CpuClass("amd", "avx2")).assert_equal(quiet_moved, theirs, "seg.0.flow.0.mel", "", log=True)


def test_a_whole_record_tree_compares_each_class_with_its_own_record_or_the_measured_spread(tmp_path, monkeypatch):
    """A plugin's tree (`RecordTree`): its own record holds for cpu.json's classes, a `cpu/<folder>` re-recording
    for the class it names (torch.equal there); any other class is compared within the spread between them."""
    from mizuoto.testing import cpu_recordings
    from mizuoto.testing.cpu_recordings import RecordTree

    own = tmp_path / "cases" / "c"
    own.mkdir(parents=True)
    save_file({"wav": torch.ones(4), "codes": torch.tensor([1, 2])}, str(own / "record.safetensors"))
    (tmp_path / "cpu.json").write_text(json.dumps({"recorded_on": ["intel-amx"]}))
    other = tmp_path / "cpu" / "intel-avx2" / "cases" / "c"
    other.mkdir(parents=True)
    save_file({"wav": torch.tensor([1.0, 1.0, 1.0 + 2**-10, 1.0]), "codes": torch.tensor([1, 2])},
              str(other / "record.safetensors"))
    (other / "case.json").write_text(json.dumps({"cpu_class": "intel-avx2"}))
    tree = RecordTree(tmp_path, what="toy cases")
    for name, folder, exact in (("intel-amx", None, True), ("intel-avx2", other.parents[1], True),
                                ("amd-avx2", None, False)):
        monkeypatch.setattr(cpu_recordings, "this_class", lambda n=name: CpuClass.parse(n))
        found = tree.comparison("c")
        assert (found.folder, found.exact) == (folder, exact), name
        assert tree.record_path("c") == (folder or tmp_path) / "cases" / "c" / "record.safetensors"
    assert found.bound("wav") == 2**-10 and "NOT checkable" in tree.describe(["c"])
    found.assert_equal(torch.full((4,), 1 + 2**-11), torch.ones(4), "wav", "within the spread")
    with pytest.raises(AssertionError, match="not torch.equal"):
        found.assert_equal(torch.tensor([1, 3]), torch.tensor([1, 2]), "codes", "integers never differ by class")

"""Which recording of upstream's values this machine is compared with, and how (one rule for every tree).

Upstream's float results depend on the kernels torch's libraries pick, and those depend on the
*CPU class*: the vendor (oneDNN and MKL dispatch on it; the suite steers MKL onto its Intel
paths, `mkl_intel.py`, oneDNN is not steered) and the widest vector ISA in use (`amx`: AVX-512
with AMX tiles, `avx512`, `avx2`, `baseline`): the CPU's flags, narrowed by torch's CPU capability
and by `$MKL_ENABLE_INSTRUCTIONS` / `$MKL_CBWR` / `$ONEDNN_MAX_CPU_ISA` when they cap the kernels.
A model name is no class: "AMD EPYC" names a Zen 1 (AVX2) and a Zen 4 (AVX-512).

A fixture tree's own recording was made on one class (`RECORDED_ON`, or the tree's `cpu.json`
`{"recorded_on": [...]}`: the classes it is known to hold for). Recordings for other classes sit
in the tree's `cpu/<folder>/`, each naming its class (`cpu_class`, else the `cpu` field as
`lscpu` model name plus avx512*/amx* flags, else the folder's name). The rule:

- a recording of this class exists (the tree's own or a `cpu/` folder): every tensor is
  `torch.equal` to it;
- none exists: integer tensors (text ids, speech tokens, draws) are still `torch.equal`; a float
  tensor is compared with the tree's own recording within the largest difference upstream itself
  shows between the recorded classes for that kind of tensor, as a fraction of the tensor's
  largest magnitude (`relative`, measured from the recordings, printed; a fraction carries over
  to a case of other loudness or length, an absolute figure would not), and bit-exactness is
  reported as not checkable here.

The full-pipeline `cpu/` folders hold per case only the tensors that differ
(`<v>/cases/<case>.{json,safetensors}`, `max_abs_diff` per name); whole-record trees (the
Chatterbox plugin's) measure their bounds from the records themselves (`measured_bounds`).
Trees that hold one class's recording only (`frontend/`, `cosyvoice/`, `train/`) borrow, where
unrecorded, the full-pipeline spread of the same quantity (`tree_comparison`).
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from mizuoto.testing.fixtures import fixtures_root

CPU_FOLDER = "cpu"
ISAS = ("baseline", "avx2", "avx512", "amx")  # narrowest first
VENDORS = {"GenuineIntel": "intel", "AuthenticAMD": "amd"}
# The class the fixture trees' own recordings were made on (full/README.md: an Intel CPU; the
# recording machine and this project's Intel machines are Xeons with AVX-512 and AMX).
RECORDED_ON = ("intel-amx",)
# The full-pipeline kinds a test of another tree names for its quantity (`tree_comparison`)
FRONT_END = "seg.<i>.input.prompt_speech_feat"  # the prompt mel: the front end's features and waveforms
EMBEDDING = "seg.<i>.input.llm_embedding"  # CAM++'s speaker embedding
FLOW_MEL = "seg.<i>.flow.<i>.mel"
HIFT_MEL = "seg.<i>.hift.<i>.mel"
SPEECH = "seg.<i>.hift.<i>.speech"  # HiFT's speech (and its source, at the same rate)
CHUNK = "seg.<i>.chunk.<i>"
_FLAG = re.compile(r"avx512\w*|amx\w*")
_INDEX = re.compile(r"\.\d+(?=\.|$)")


@dataclass(frozen=True, order=True)
class CpuClass:
    """What decides the kernels: vendor (`intel`, `amd`, `other`) and widest ISA in use."""

    vendor: str
    isa: str

    @property
    def name(self) -> str:
        """`<vendor>-<isa>`, e.g. `amd-avx2`."""
        return f"{self.vendor}-{self.isa}"

    def __str__(self) -> str:
        return self.name

    @classmethod
    def parse(cls, name: str) -> CpuClass:
        """`amd-avx2` -> CpuClass("amd", "avx2")."""
        vendor, _, isa = name.strip().lower().partition("-")
        if isa not in ISAS:
            raise ValueError(f"CPU class {name!r}: expected <vendor>-<isa> with isa one of {ISAS}")
        return cls(vendor, isa)


def isa_of_flags(flags: Iterable[str]) -> str:
    """The widest ISA a CPU's /proc/cpuinfo flags offer (torch's AVX512 needs F, BW, VL and DQ)."""
    flags = set(flags)
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "amx" if "amx_tile" in flags else "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return "baseline"


def _narrowest(*isas: str | None) -> str:
    return min((i for i in isas if i), key=ISAS.index)


def _capped_isa(env: Mapping[str, str], capability: str) -> str | None:
    """The widest ISA that torch's capability and the libraries' ISA caps in `env` allow (None: no cap)."""
    # torch's capability names no AMX: its AVX512 caps nothing, only a narrower one does
    caps = [capability if "512" not in capability else ""]
    caps += [env.get(k, "") for k in ("MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA")]
    found = []
    for cap in (c.upper() for c in caps if c):
        if "AMX" in cap or cap in ("ALL", "AUTO", "DEFAULT_CPU_ISA"):
            continue
        if "512" in cap:
            found.append("avx512")
        elif "AVX2" in cap:
            found.append("avx2")
        elif cap in ("DEFAULT", "SSE4_2", "SSE41", "AVX", "COMPATIBLE"):
            found.append("baseline")
    return _narrowest(*found) if found else None


def read_cpuinfo(text: str) -> dict[str, str]:
    """The first processor's fields of a /proc/cpuinfo text."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def class_of_cpuinfo(text: str, capability: str = "", env: Mapping[str, str] | None = None) -> CpuClass:
    """The class of the CPU a /proc/cpuinfo text describes, as torch (`capability`) and `env` use it."""
    fields = read_cpuinfo(text)
    vendor = VENDORS.get(fields.get("vendor_id", ""), "other")
    isa = _narrowest(isa_of_flags(fields.get("flags", "").split()), _capped_isa(env or {}, capability))
    return CpuClass(vendor, isa)


@functools.cache
def this_class(cpuinfo: str = "/proc/cpuinfo") -> CpuClass:
    """This machine's CPU class, with torch's capability and this process's ISA caps."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        text = ""
    return class_of_cpuinfo(text, torch.backends.cpu.get_cpu_capability(), os.environ)


def class_of_recorded_cpu(text: str) -> CpuClass:
    """A recording's `cpu` field (`"AMD EPYC (avx512f avx512bw ...)"`, only avx512*/amx* flags listed) as a class.

    Such a field lists no AVX2 flag, so a CPU without AVX-512 is taken as AVX2 (every x86 recording CPU so far).
    """
    m = re.fullmatch(r"\s*(.*?)\s*(?:\(([^()]*)\))?\s*", text)
    model, flags = m.group(1), {f for f in (m.group(2) or "").split() if _FLAG.fullmatch(f)}
    vendor = "amd" if re.search(r"\bAMD\b", model) else "intel" if re.search(r"Intel", model, re.I) else "other"
    return CpuClass(vendor, isa_of_flags(flags | {"avx2", "fma"}))


def folder_class(folder: Path, manifests: list[dict[str, Any]] | None = None) -> CpuClass:
    """The class a `cpu/<folder>` recording names: its manifests' `cpu_class`, else their `cpu`, else the folder name."""
    named = {m["cpu_class"] for m in manifests or [] if "cpu_class" in m}
    named |= {class_of_recorded_cpu(m["cpu"]).name for m in manifests or [] if "cpu" in m and "cpu_class" not in m}
    if len(named) > 1:
        raise AssertionError(f"{folder}: its files name different CPU classes: {sorted(named)}")
    if named:
        return CpuClass.parse(named.pop())
    words = folder.name.lower().split("-")
    vendor = next((w for w in words if w in VENDORS.values()), "other")
    isa = next((w for w in reversed(words) if w in ISAS), None)
    if isa is None:
        raise AssertionError(f"{folder}: names no CPU class (a `cpu_class` field, a `cpu` field, or "
                             f"<vendor>-...-<isa> as its name, isa one of {ISAS})")
    return CpuClass(vendor, isa)


def recorded_on(tree: Path) -> frozenset[CpuClass]:
    """The classes a tree's own recording holds for: its `cpu.json` `recorded_on`, else `RECORDED_ON`."""
    spec = tree / f"{CPU_FOLDER}.json"
    names = json.loads(spec.read_text(encoding="utf-8"))["recorded_on"] if spec.is_file() else RECORDED_ON
    return frozenset(CpuClass.parse(n) for n in names)


def kind(name: str) -> str:
    """A tensor's kind: its name with every index replaced (`seg.1.flow.0.mel` -> `seg.<i>.flow.<i>.mel`)."""
    return _INDEX.sub(".<i>", name)


@dataclass(frozen=True)
class Comparison:
    """How this CPU's results are compared with a tree's recordings (see the module docstring).

    `folder` is the `cpu/` recording used (None: the tree's own); `exact` is False where no
    recording of this class exists; `bounds` holds, per tensor kind, the largest difference upstream
    shows between the recorded classes (0 or absent: that kind never differed), `relative` the
    same as a fraction of each tensor's largest magnitude.
    """

    cpu: CpuClass
    folder: Path | None
    exact: bool
    bounds: Mapping[str, float] = field(default_factory=dict)
    relative: Mapping[str, float] = field(default_factory=dict)
    what: str = "the cases"

    def bound(self, name: str, reference: torch.Tensor | None = None) -> float:
        """The difference a float tensor `name` (upstream's value `reference`) may show here; 0 where recorded."""
        if self.exact:
            return 0.0
        if reference is not None and kind(name) in self.relative:
            scale = reference.detach().abs().max().item() if reference.numel() else 0.0
            return float(self.relative[kind(name)]) * scale
        return float(self.bounds.get(kind(name), 0.0))

    def describe(self) -> str:
        """One line for the test report: this CPU's class and what it was compared with."""
        if self.folder is not None:
            how = f"the recording {self.folder.parent.name}/{self.folder.name} of its class, torch.equal"
        elif self.exact:
            how = "the fixtures' own recording (made on this class), torch.equal"
        else:
            shown = ", ".join(f"{k} {v:.3g}" for k, v in sorted(self.relative.items()) if v) or "none"
            how = ("no recording of this class: bit-exactness is NOT checkable here; integer tensors torch.equal, "
                   "float tensors within what upstream shows between recorded classes, as a fraction of the "
                   f"tensor's largest value ({shown}), else torch.equal")
        return f"CPU class {self.cpu}: {self.what} compared with {how}"

    def assert_equal(self, ours: torch.Tensor, theirs: torch.Tensor, name: str, what: str, log: bool = False) -> None:
        """`torch.equal`, or, on a class with no recording, a float tensor within its kind's bound.

        `log`: the tensors are logs of energies (a log filterbank), compared where unrecorded as the
        energies they stand for: a band that holds almost no energy takes a large log difference from
        the least rounding (kaldi's fbank: up to 2.6e-3 between CPUs), which no energy shows.
        """
        if log and not self.exact and not torch.equal(ours, theirs):
            ours, theirs = ours.double().exp().float(), theirs.double().exp().float()
        limit = self.bound(name, theirs) if theirs.is_floating_point() else 0.0
        if limit == 0.0 and torch.equal(ours, theirs):
            return
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype, \
            f"{what}: shape or dtype {tuple(ours.shape)} {ours.dtype} against {tuple(theirs.shape)} {theirs.dtype}"
        diff = (ours.double() - theirs.double()).abs().max().item() if ours.numel() else 0.0
        assert limit != 0.0, f"{what}: not torch.equal (max abs diff {diff:.3g})"
        assert diff <= limit, f"{what}: max abs diff {diff:.3g} > {limit:.3g} ({kind(name)}; no recording of class {self.cpu})"


def merge_bounds(*found: Mapping[str, float]) -> dict[str, float]:
    """Per kind, the largest of several bound tables."""
    out: dict[str, float] = {}
    for table in found:
        for k, v in table.items():
            out[k] = max(out.get(k, 0.0), float(v))
    return out


def measured_bounds(base: Mapping[str, torch.Tensor], other: Mapping[str, torch.Tensor],
                    relative: bool = False) -> dict[str, float]:
    """Per kind, max |other - base| (`relative`: over max |base|) of the float tensors two records of a case share."""
    out: dict[str, float] = {}
    for name, theirs in other.items():
        ours = base.get(name)
        if ours is None or not ours.is_floating_point() or ours.shape != theirs.shape or not ours.numel():
            continue
        diff = (theirs.double() - ours.double()).abs().max().item()
        scale = ours.double().abs().max().item() if relative else 1.0
        out = merge_bounds(out, {kind(name): diff / scale if scale else 0.0})
    return out


# -- the full-pipeline tree: per-case difference files ---------------------------------------------
@dataclass(frozen=True)
class CpuRecording(Comparison):
    """The full-pipeline recording this class is compared with; `apply` puts its values into a case."""

    what: str = "full-pipeline cases"

    def overlay(self, version: str, case: str) -> dict[str, Any] | None:
        """This class's manifest for one case (its `differs`, `sha256_tts_speech_f32`), or None."""
        if self.folder is None:
            return None
        path = self.folder / version / "cases" / f"{case}.json"
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None

    def apply(self, version: str, case: str, meta: dict[str, Any], tensors: dict[str, Any]) -> None:
        """Put this class's values of a case into its manifest and tensors (nothing if none differ)."""
        found = self.overlay(version, case)
        if found is None:
            return
        from safetensors.torch import load_file

        values = load_file(str(self.folder / version / "cases" / f"{case}.safetensors"))
        missing = set(found["differs"]) - set(values)
        if missing:
            raise AssertionError(f"{self.folder}: {version}/{case} lists {sorted(missing)} but stores no value")
        integer = [n for n in found["differs"] if not values[n].is_floating_point()
                   or (n in tensors and not tensors[n].is_floating_point())]
        if integer:
            raise AssertionError(f"{self.folder}: {version}/{case}: integer tensors {integer} differ by CPU; "
                                 "upstream's integer results (ids, tokens, draws) are the same on every CPU")
        for name in found["differs"]:
            tensors[name] = values[name]
        meta["sha256_tts_speech_f32"] = found["sha256_tts_speech_f32"]


def _scale(full: Path, version: str, case: str, name: str) -> float:
    """max |value| of a tensor of a full-pipeline case as the tree records it (aliases resolved)."""
    path = full / version / "cases" / f"{case}.json"
    tensors = _case_tensors(path)
    value = tensors.get(name)
    if value is None:
        raise AssertionError(f"{path}: no tensor {name!r}, which a per-class recording lists")
    return value.double().abs().max().item() if value.numel() else 0.0


@functools.lru_cache(maxsize=8)
def _case_tensors(path: Path) -> dict[str, torch.Tensor]:
    from mizuoto.testing.fixtures import load_tensors

    return load_tensors(path, json.loads(path.read_text(encoding="utf-8")))


def _recorded_classes(full: Path) -> list[tuple[Path, CpuClass, dict[str, float], dict[str, float]]]:
    """Each `full/cpu/<folder>` with its class and, per kind, the largest difference it records (absolute, relative)."""
    out = []
    for folder in sorted(p for p in (full / CPU_FOLDER).glob("*") if p.is_dir()):
        paths = sorted(folder.glob("*/cases/*.json"))
        metas = [json.loads(p.read_text(encoding="utf-8")) for p in paths]
        if not metas:
            continue
        absolute: dict[str, float] = {}
        relative: dict[str, float] = {}
        for path, meta in zip(paths, metas):
            for name, diff in meta.get("max_abs_diff", {}).items():
                scale = _scale(full, path.parent.parent.name, path.stem, name)
                absolute = merge_bounds(absolute, {kind(name): diff})
                relative = merge_bounds(relative, {kind(name): diff / scale if scale else 0.0})
        out.append((folder, folder_class(folder, metas), absolute, relative))
    return out


def recording_for(full: Path, cpu: CpuClass) -> CpuRecording:
    """The recording of the `full` tree that class `cpu` is compared with (see the module docstring)."""
    recorded = _recorded_classes(full)
    bounds = merge_bounds(*(a for _, _, a, _ in recorded))
    relative = merge_bounds(*(r for _, _, _, r in recorded))
    for folder, named, _, _ in recorded:
        if named == cpu:
            return CpuRecording(cpu, folder, True, bounds, relative)
    return CpuRecording(cpu, None, cpu in recorded_on(full), bounds, relative)


@functools.cache
def recording_for_this_cpu(full: Path | None = None) -> CpuRecording:
    """The recording this machine's class is compared with, in `full` (default the fixtures' `full/`)."""
    return recording_for(full or fixtures_root() / "full", this_class())


@functools.cache
def tree_comparison(tree: str) -> Comparison:
    """How a fixture tree other than `full/` (`frontend`, `cosyvoice`, ...) is compared on this machine's class.

    Such a tree holds no recording of another class: on a class it was not recorded on, its float
    tensors are compared within the spread the full-pipeline recordings measure for the same
    quantity (a test names that kind: `seg.<i>.flow.<i>.mel` for a flow mel, ...).
    """
    full = recording_for_this_cpu()
    return Comparison(full.cpu, None, full.cpu in recorded_on(fixtures_root() / tree), full.bounds, full.relative,
                      what=f"{tree}/ fixtures")


# -- whole-record trees (the plugins'): per-class re-recordings of every case -------------------------------------
class RecordTree:
    """A plugin's tree of whole records, `cases/<case>/<record>`, and its per-class re-recordings.

    Re-recordings sit in `<root>/cpu/<folder>/cases/<case>/` (and in the `extra` places, each a
    folder of `<folder>/` class recordings), each folder naming its class (`folder_class`). A case
    is compared with the record of this machine's class where one exists, else with the tree's
    own within the spread upstream shows between the recorded classes (`measured_bounds`).
    """

    def __init__(self, root: Path, record: str = "record.safetensors", what: str = "the cases",
                 extra: Iterable[Path] = ()) -> None:
        self.root, self.record, self.what, self.extra = Path(root), record, what, tuple(extra)

    def class_folders(self) -> list[Path]:
        """The tree's per-class re-recordings (`cpu/<folder>` and the `extra` places)."""
        places = [self.root / CPU_FOLDER, *self.extra]
        return sorted(p for place in places if place.is_dir() for p in place.iterdir() if (p / "cases").is_dir())

    @functools.cached_property
    def classes(self) -> tuple[dict[CpuClass, Path], dict[str, float], dict[str, float]]:
        """Class -> its folder; per tensor kind, the largest difference between any two recorded classes
        (absolute, and relative to the tensor's largest magnitude)."""
        from safetensors.torch import load_file

        folders: dict[CpuClass, Path] = {}
        bounds: dict[str, float] = {}
        relative: dict[str, float] = {}
        for folder in self.class_folders():
            named = folder_class(folder, [json.loads(p.read_text(encoding="utf-8"))
                                          for p in folder.glob("cases/*/case.json")])
            if named in folders:
                raise AssertionError(f"{folder} and {folders[named]} both record class {named}")
            folders[named] = folder
            for record in sorted(folder.glob(f"cases/*/{self.record}")):
                own = self.root / "cases" / record.parent.name / self.record
                if own.is_file():
                    base, other = load_file(str(own)), load_file(str(record))
                    bounds = merge_bounds(bounds, measured_bounds(base, other))
                    relative = merge_bounds(relative, measured_bounds(base, other, relative=True))
        return folders, bounds, relative

    def comparison(self, case: str) -> Comparison:
        """How `case` is compared on this machine's CPU class."""
        cpu = this_class()
        folders, bounds, relative = self.classes
        folder = folders.get(cpu)
        if folder is not None and (folder / "cases" / case / self.record).is_file():
            return Comparison(cpu, folder, True, bounds, relative, what=self.what)
        return Comparison(cpu, None, cpu in recorded_on(self.root), bounds, relative, what=self.what)

    def record_path(self, case: str) -> Path:
        """The record `case` is compared with here: this CPU class's where the tree has one."""
        folder = self.comparison(case).folder
        return (folder if folder is not None else self.root) / "cases" / case / self.record

    def describe(self, cases: list[str]) -> str:
        """One line for the test report: this CPU's class and what the cases were compared with."""
        if not cases:
            return f"no {self.what}"
        exact = [c for c in cases if self.comparison(c).exact]
        line = self.comparison(cases[0]).describe()
        if len(exact) not in (0, len(cases)):
            line += f" ({len(exact)} of {len(cases)} cases recorded on this class; the rest as unrecorded)"
        return line

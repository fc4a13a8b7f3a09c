"""Which CPU's recording of the full-pipeline fixtures this machine is compared with.

The `full/` cases were recorded by upstream on one CPU (an Intel one, `full/README.md`). A few
tensors depend on the CPU that computes them: oneDNN blocks HiFT's strided source convolution
differently per CPU (1-ulp sums), so on an AMD EPYC upstream itself gives other HiFT speech.
`full/cpu/<name>/<v>/cases/<case>.json` (+ `.safetensors`) records, per other CPU, each case's
tensors that differ there and the sha256 of its audio; a case without a file was reproduced bit
for bit. This module picks the recording for the CPU it runs on:

- a `full/cpu/*` recording whose `cpu` (model name and avx512/amx flags) is this CPU's: its values;
- otherwise, on an Intel CPU: the fixtures themselves;
- otherwise none: the CPU-dependent tensors (by upstream's faithfulness rule only HiFT speech,
  the chunks made from it and the output) are compared within `CROSS_CPU_ATOL`, the largest
  difference between CPUs seen, and bit-exactness is reported as not checkable here. Every other
  tensor stays `torch.equal` everywhere.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mizuoto.testing.fixtures import fixtures_root

CPU_FOLDER = "cpu"
# Upstream's faithfulness rule for the per-CPU recordings: only these may differ between CPUs.
CPU_DEPENDENT = re.compile(r"seg\.\d+\.hift\.\d+\.speech|seg\.\d+\.chunk\.\d+|output\.tts_speech")
# The largest |difference| between two CPUs' upstream runs seen on those tensors: 1.136e-7 on
# HiFT speech (Intel vs AMD EPYC Zen 4, full/cpu/README.md), rounded up. A tree whose recordings
# hold a larger one raises the bound to it (`Recording.atol`).
CROSS_CPU_ATOL = 1.2e-7
_FLAG = re.compile(r"avx512\w*|amx\w*")


@dataclass(frozen=True)
class Cpu:
    """A CPU as the recordings name it: model name and its avx512*/amx* flags."""

    model: str
    vendor: str
    flags: frozenset[str]

    def __str__(self) -> str:
        return f"{self.model} ({' '.join(sorted(self.flags)) or 'no avx512/amx'})"


def parse_cpu(text: str) -> tuple[str, frozenset[str]]:
    """A recording's `cpu` field, `"AMD EPYC (avx512f avx512dq ...)"`, as (model name, flags)."""
    m = re.fullmatch(r"\s*(.*?)\s*(?:\(([^()]*)\))?\s*", text)
    return m.group(1), frozenset(f for f in (m.group(2) or "").split() if _FLAG.fullmatch(f))


@functools.cache
def this_cpu(cpuinfo: str = "/proc/cpuinfo") -> Cpu:
    """This machine's CPU, from the first processor of /proc/cpuinfo."""
    fields: dict[str, str] = {}
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            if not line.strip():
                break
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    except OSError:
        pass
    flags = frozenset(f for f in fields.get("flags", "").split() if _FLAG.fullmatch(f))
    return Cpu(fields.get("model name", "unknown"), fields.get("vendor_id", "unknown"), flags)


@dataclass(frozen=True)
class CpuRecording:
    """The recording of the full-pipeline cases this CPU is compared with.

    `folder` is a `full/cpu/<name>` folder, or None for the fixtures' own recording; `exact` is
    False where no recording exists for this CPU.
    """

    cpu: Cpu
    folder: Path | None
    exact: bool
    atol: float

    def describe(self) -> str:
        """One line for the test report: this CPU and what it is compared with."""
        if self.folder is not None:
            what = f"the per-CPU recording {self.folder.parent.parent.name}/{CPU_FOLDER}/{self.folder.name} " \
                   "over the fixtures, torch.equal"
        elif self.exact:
            what = "the fixtures' own (Intel) recording, torch.equal"
        else:
            what = (f"no recording for this CPU: bit-exactness is NOT checkable here; CPU-dependent tensors "
                    f"(HiFT speech, chunks, output) within {self.atol:.3g}, every other tensor torch.equal")
        return f"CPU {self.cpu}: full-pipeline cases compared with {what}"

    def overlay(self, version: str, case: str) -> dict[str, Any] | None:
        """This CPU's manifest for one case (its `differs`, `sha256_tts_speech_f32`), or None."""
        if self.folder is None:
            return None
        path = self.folder / version / "cases" / f"{case}.json"
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None

    def apply(self, version: str, case: str, meta: dict[str, Any], tensors: dict[str, Any]) -> None:
        """Put this CPU's values of a case into its manifest and tensors (nothing if none differ)."""
        found = self.overlay(version, case)
        if found is None:
            return
        from safetensors.torch import load_file

        values = load_file(str(self.folder / version / "cases" / f"{case}.safetensors"))
        missing = set(found["differs"]) - set(values)
        if missing:
            raise AssertionError(f"{self.folder}: {version}/{case} lists {sorted(missing)} but stores no value")
        stray = [name for name in found["differs"] if not CPU_DEPENDENT.fullmatch(name)]
        if stray:
            raise AssertionError(f"{self.folder}: {version}/{case}: {stray} differ by CPU, which the "
                                 "faithfulness rule does not allow")
        for name in found["differs"]:
            tensors[name] = values[name]
        meta["sha256_tts_speech_f32"] = found["sha256_tts_speech_f32"]

    def assert_equal(self, ours: torch.Tensor, theirs: torch.Tensor, name: str, what: str) -> None:
        """`torch.equal`, or within `atol` for a CPU-dependent tensor on a CPU with no recording."""
        if self.exact or not CPU_DEPENDENT.fullmatch(name):
            assert torch.equal(ours, theirs), what
            return
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype, f"{what}: shape or dtype"
        diff = (ours - theirs).abs().max().item() if ours.numel() else 0.0
        assert diff <= self.atol, f"{what}: max abs diff {diff:.3g} > {self.atol:.3g} (no recording for this CPU)"


def _recorded_cpus(full: Path) -> list[tuple[Path, tuple[str, frozenset[str]], float]]:
    """Each `full/cpu/<name>` folder with the CPU its manifests name and the largest difference they record."""
    out = []
    for folder in sorted(p for p in (full / CPU_FOLDER).glob("*") if p.is_dir()):
        metas = [json.loads(p.read_text(encoding="utf-8")) for p in sorted(folder.glob("*/cases/*.json"))]
        names = {m["cpu"] for m in metas}
        if len(names) > 1:
            raise AssertionError(f"{folder}: its cases name different CPUs: {sorted(names)}")
        if names:
            largest = max((d for m in metas for d in m.get("max_abs_diff", {}).values()), default=0.0)
            out.append((folder, parse_cpu(names.pop()), largest))
    return out


def recording_for(full: Path, cpu: Cpu) -> CpuRecording:
    """The recording of the `full` tree that `cpu` is compared with (see the module docstring)."""
    recorded = _recorded_cpus(full)
    atol = max([CROSS_CPU_ATOL, *(largest for _, _, largest in recorded)])
    for folder, (model, flags), _ in recorded:
        if model == cpu.model and flags == cpu.flags:
            return CpuRecording(cpu, folder, True, atol)
    return CpuRecording(cpu, None, cpu.vendor == "GenuineIntel", atol)


@functools.cache
def recording_for_this_cpu(full: Path | None = None) -> CpuRecording:
    """The recording this machine's CPU is compared with, in `full` (default the fixtures' `full/`)."""
    return recording_for(full or fixtures_root() / "full", this_cpu())

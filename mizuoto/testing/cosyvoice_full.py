"""The full-pipeline CosyVoice cases (`full/<version>/cases/<case>.json`): upstream run from raw text and wavs.

Each manifest says how its model dir was assembled (`assembled_model_dir`), how its LM was
modified, if at all (`model_modification`), and which public call made it (`mode`,
`raw_inputs`, `stream`, `speed`, `seed`). Helpers here turn those into a model directory and
a Mizuoto request; the tests compare every recorded intermediate. Nothing here names a case.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mizuoto.runtime.engine import Reference, SynthesisRequest
from mizuoto.testing.cpu_recordings import CpuRecording, recording_for_this_cpu
from mizuoto.testing.fixtures import Recording, assets_root, fixtures_root, load_tensors, read_manifest

FULL = "full"
AUDIO = "audio"
# upstream's public calls -> the Mizuoto mode that makes the same model input
MODE_OF_CALL = {"sft": "preset", "zero_shot": "clone", "cross_lingual": "cross_lingual", "instruct": "instruct",
                "instruct2": "instruct", "vc": "vc", "bistream": "clone", "bistream_lm": "clone"}
# cases that record only the LM's tokens (upstream's llm.inference_bistream called alone)
LM_ONLY_MODES = frozenset({"bistream_lm"})


@dataclass
class FullCase(Recording):
    """A loaded full-pipeline case (`meta`, `tensors`) and its manifest's path."""

    json_path: Path = field(kw_only=True)
    cpu: CpuRecording = field(kw_only=True)

    @property
    def id(self) -> str:
        """A test id such as `v2-zero_shot_zh_digits`."""
        return f"{self.json_path.parent.parent.name}-{self.json_path.stem}"

    @property
    def segments(self) -> list[dict[str, Any]]:
        """The manifest's per-segment records (one per upstream model.tts call)."""
        return list(self.meta["segments"])

    def seg(self, i: int, name: str) -> torch.Tensor | None:
        """Tensor `seg.<i>.<name>`, or None."""
        return self.tensors.get(f"seg.{i}.{name}")

    def numbered(self, i: int, prefix: str, suffix: str = "") -> list[torch.Tensor]:
        """`seg.<i>.<prefix>.0<suffix>`, `.1<suffix>`, ... in order, for as long as they exist."""
        out, j = [], 0
        while f"seg.{i}.{prefix}.{j}{suffix}" in self.tensors:
            out.append(self.tensors[f"seg.{i}.{prefix}.{j}{suffix}"])
            j += 1
        return out

    @property
    def lm_only(self) -> bool:
        """Whether upstream ran only the LM for this case (no audio recorded)."""
        return self.meta["mode"] in LM_ONLY_MODES


def full_root(root: Path | None = None) -> Path:
    """The `full/` folder of the fixture tree; missing is an error, never a skip."""
    path = (root or fixtures_root()) / FULL
    if not path.is_dir():
        raise FileNotFoundError(f"full-pipeline fixtures not found at {path}")
    return path


def list_full_cases(root: Path | None = None) -> list[Path]:
    """Every case manifest under `full/*/cases/` (a json with `raw_inputs` and `tensor_file`), sorted."""
    return [p for p in sorted(full_root(root).glob("*/cases/*.json")) if read_manifest(p, "raw_inputs", "tensor_file")]


def load_full_case(path: Path) -> FullCase:
    """A case's manifest and tensors, as recorded for this machine's CPU (`cpu_recordings`)."""
    meta = json.loads(path.read_text(encoding="utf-8"))
    tensors = load_tensors(path, meta)
    cpu = recording_for_this_cpu(path.parent.parent.parent)
    cpu.apply(path.parent.parent.name, path.stem, meta, tensors)
    return FullCase(meta, tensors, json_path=path, cpu=cpu)


# -- model dir -----------------------------------------------------------------------------------
def shared_path(text: str) -> Path | None:
    """A `shared/fixtures/...` or `shared/assets/...` path of a manifest, resolved in this tree (None if neither)."""
    word = text.split()[0] if text.split() else ""
    for prefix, base in (("shared/fixtures/", fixtures_root), ("shared/assets/", assets_root)):
        if word.startswith(prefix):
            return base() / word[len(prefix):]
    return None


def _expand(key: str) -> list[str]:
    """`dir/{a,b}` -> [`dir/a`, `dir/b`]; other keys as they are."""
    m = re.fullmatch(r"(.*)\{([^}]*)\}(.*)", key)
    return [m.group(1) + part + m.group(3) for part in m.group(2).split(",")] if m else [key]


def model_files(assembly: dict[str, str]) -> dict[str, Path]:
    """Model-dir relative path -> source file, from a manifest's `assembled_model_dir`.

    Entries whose value is not a path of the tree (weights "not stored", tokenizer notes) and
    shared resources (an entry naming no file of the model dir, such as the FST folder) are
    left out: the runtime finds resources itself, as on a user's machine.
    """
    files: dict[str, Path] = {}
    for key, value in assembly.items():
        src = shared_path(value)
        if src is None:
            continue
        if "all files of" in key:
            for item in sorted(src.rglob("*")):
                if item.is_file() and not any(part.startswith(".") for part in item.relative_to(src).parts):
                    files.setdefault(str(item.relative_to(src)), item)
            continue
        if "." not in key and "/" not in key:
            continue  # a resource (e.g. "wetext_fsts"), not a file of the model dir
        for name in _expand(key):
            if src.is_dir():
                files[name] = src / Path(name).name
            else:
                files[name] = src
    return files


def assemble(meta: dict[str, Any], dest: Path) -> Path:
    """The case's model dir in `dest`: its files linked, its LM modification applied to a copy of llm.pt."""
    files = model_files(meta["assembled_model_dir"])
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"files named by {meta.get('case')}'s assembled_model_dir are missing: {missing}")
    for name, src in files.items():
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(src.resolve())
    if meta.get("model_modification"):
        llm = dest / "llm.pt"
        source = llm.resolve()
        llm.unlink()
        digest = apply_model_modification(meta["model_modification"], source, llm)
        expected = re.search(r"sha256 of the saved copy ([0-9a-f]{64})", meta["model_modification"])
        if expected and digest != expected.group(1):
            raise AssertionError(f"modified llm.pt has sha256 {digest}, the manifest says {expected.group(1)}")
    return dest


_ASSIGN = re.compile(r"^w\[(\d+)(?::(\d+))?\]\s*(\*?=)\s*(-?[\d.]+(?:e-?\d+)?)$")


def apply_model_modification(text: str, source: Path, dest: Path) -> str:
    """Apply a manifest's `model_modification` (`w = sd["k"]; w[i] = v; w[a:b] = v; w[i] *= v`) and save.

    Only that statement form is accepted; anything else is an error rather than a guess.
    Returns the sha256 of the saved file.
    """
    found = re.search(r"sd = torch\.load\(.*?torch\.save\([^)]*\)", text)
    if not found:
        raise ValueError(f"model_modification is not `sd = torch.load(...); ...; torch.save(...)`: {text!r}")
    statements = [s.strip() for s in found.group(0).split(";")]
    key = None
    edits = []
    for s in statements:
        if not s or s.startswith("sd = torch.load") or s.startswith("torch.save"):
            continue
        m = re.fullmatch(r"w = sd\[\"([^\"]+)\"\]", s)
        if m:
            key = m.group(1)
            continue
        m = _ASSIGN.match(s)
        if not m:
            raise ValueError(f"model_modification statement not understood: {s!r}")
        edits.append(m.groups())
    if key is None or not edits:
        raise ValueError(f"model_modification names no tensor or no edit: {text!r}")
    sd = torch.load(source, map_location="cpu", weights_only=True)
    w = sd[key]
    for start, stop, op, value in edits:
        rows = slice(int(start), int(stop)) if stop else int(start)
        if op == "=":
            w[rows] = float(value)
        else:
            w[rows] *= float(value)
    torch.save(sd, dest)
    return hashlib.sha256(dest.read_bytes()).hexdigest()


# -- request -------------------------------------------------------------------------------------
def audio_file(meta: dict[str, Any], key: str, root: Path | None = None) -> Path:
    """A raw input wav, read from `full/audio/` by file name."""
    path = full_root(root) / AUDIO / Path(meta["raw_inputs"][key]).name
    if not path.is_file():
        raise FileNotFoundError(f"raw input wav missing: {path}")
    return path


def request_for(meta: dict[str, Any], *, stream: bool | None = None) -> SynthesisRequest:
    """The Mizuoto request that makes upstream's recorded call from the same raw inputs."""
    raw = meta["raw_inputs"]
    mode = MODE_OF_CALL[meta["mode"]]
    stream = bool(meta.get("stream", False)) if stream is None else stream
    common = {"mode": mode, "seed": int(meta["seed"]), "stream": stream, "speed": float(meta.get("speed", 1.0))}
    text = iter(raw["tts_pieces"]) if "tts_pieces" in raw else raw.get("tts_text")
    if mode == "vc":
        return SynthesisRequest(voice=Reference(str(audio_file(meta, "prompt_wav"))),
                                source_audio=str(audio_file(meta, "source_wav")), **common)
    voice = raw["spk_id"] if "spk_id" in raw else Reference(str(audio_file(meta, "prompt_wav")), raw.get("prompt_text"))
    return SynthesisRequest(text, voice=voice, instruct=raw.get("instruct_text"), **common)


def snr_db(reference: torch.Tensor, test: torch.Tensor) -> float:
    """SNR of `test` against `reference` in dB (inf when equal); lengths must match."""
    ref, got = reference.double().flatten(), test.double().flatten()
    if ref.shape != got.shape:
        raise AssertionError(f"lengths differ: {ref.numel()} vs {got.numel()} samples")
    noise = float(((ref - got) ** 2).sum())
    signal = float((ref ** 2).sum())
    return float("inf") if noise == 0 else 10 * torch.log10(torch.tensor(signal / noise)).item()


# -- streamed text -------------------------------------------------------------------------------
def tiny_model_dir(meta: dict[str, Any]) -> Path | None:
    """The fixture model dir whose every file a case's model dir takes (its `... (all files of)` entry)."""
    for key, value in meta["assembled_model_dir"].items():
        if "all files of" in key:
            return shared_path(value)
    return None


def streamed_text_cases(root: Path | None = None) -> list[dict[str, Any]]:
    """Manifests of the cases whose text upstream got as a generator of pieces."""
    metas = [json.loads(p.read_text(encoding="utf-8")) for p in list_full_cases(root)]
    return [m for m in metas if "tts_pieces" in m["raw_inputs"]]


def stream_input(meta: dict[str, Any]) -> dict[str, Any]:
    """A case's streamed text, reference and seed, as the contract suite's $MIZUOTO_CONTRACT_STREAM_TEXT entry."""
    raw = meta["raw_inputs"]
    return {"pieces": list(raw["tts_pieces"]), "ref_audio": str(audio_file(meta, "prompt_wav")),
            "ref_text": raw.get("prompt_text"), "seed": int(meta["seed"])}

"""A second fixture tree of the same layout, derived from one: the suite run on it catches tests that lean on one tree.

Upstream recorded the truth for the inputs of each case, so a derived tree cannot change a
recorded case's inputs; it changes everything the layout leaves free:

- every case (`cosyvoice/<v>/cases`, `full/<v>/cases` and their per-CPU recordings) gets another
  name, in another sorted order;
- tensors stored once for several names (`aliases`) are stored under each name;
- each `hift.pt` takes the legacy key style upstream's loader accepts (`generator.` prefix,
  `weight_g` / `weight_v`);
- the front end's shortest clip is left out, so "the shortest clip" and "the first clip" are others.

What the tests choose themselves (seeds, text lengths) changes through `$MIZUOTO_TEST_SHIFT`
(`mizuoto.testing.variation`), which the second run sets. Everything else is linked, not copied.

    python -m mizuoto.testing.derived_tree SRC DEST
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import torch

from mizuoto.testing.fixtures import load_tensors, read_manifest

_CASE_FOLDERS = ("cosyvoice/*/cases", "full/*/cases")
_PARAMETRIZED = ".parametrizations.weight.original"
_PREFIX = "generator."


def case_name(name: str) -> str:
    """A case's name in the derived tree: unrelated to the original and sorted differently."""
    return "c" + hashlib.sha256(name.encode()).hexdigest()[:8]


def _is_case(meta: dict[str, Any] | None) -> bool:
    return meta is not None and "tensor_file" in meta and ("model_dir_relative_to_this_file" in meta
                                                           or "raw_inputs" in meta)


def _write_case(src_json: Path, meta: dict[str, Any], dest_cases: Path) -> None:
    """The case under its new name, each alias stored as a tensor of its own."""
    from safetensors.torch import save_file

    new = case_name(src_json.stem)
    tensors = load_tensors(src_json, meta)
    out = dict(meta, tensor_file=f"{new}.safetensors")
    out.pop("aliases", None)
    if "case" in out:
        out["case"] = new
    save_file({k: v.contiguous().clone() for k, v in tensors.items()}, str(dest_cases / out["tensor_file"]))
    (dest_cases / f"{new}.json").write_text(json.dumps(out, indent=1, ensure_ascii=False), encoding="utf-8")


def legacy_hift(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A HiFT state dict in the legacy style: `generator.` prefix, weight norm as `weight_g` / `weight_v`."""
    out = {}
    for key, value in state.items():
        if _PARAMETRIZED in key:
            stem, index = key.split(_PARAMETRIZED)
            key = stem + (".weight_g" if index == "0" else ".weight_v")
        out[key if key.startswith(_PREFIX) else _PREFIX + key] = value  # a legacy file stays as it is
    return out


def _link(src: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.symlink_to(src.resolve())


def derive(src: Path, dest: Path) -> Path:
    """Write the derived tree of `src` into `dest` (which must not exist)."""
    if dest.exists():
        raise FileExistsError(f"{dest} exists")
    cases = {p for pattern in _CASE_FOLDERS for p in src.glob(pattern)}
    cpu_cases = set(src.glob("full/cpu/*/*/cases"))
    front = src / "frontend"
    manifest = json.loads((front / "manifest.json").read_text(encoding="utf-8"))
    clips = manifest["clips"]
    shortest = min(clips, key=lambda c: clips[c]["num_samples"] / clips[c]["sample_rate"])
    dropped = {Path(clips[shortest]["wav"]).name, f"{shortest}.safetensors"}
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        out = dest / rel
        if path.is_dir():
            continue
        if path.parent in cases:
            meta = read_manifest(path, "tensor_file") if path.suffix == ".json" else None
            if _is_case(meta):
                out.parent.mkdir(parents=True, exist_ok=True)
                _write_case(path, meta, out.parent)
            elif path.suffix == ".json" or not _is_case(read_manifest(path.with_suffix(".json"), "tensor_file")):
                _link(path, out)  # not a case (construction noise): as it is
        elif path.parent in cpu_cases:
            renamed = out.with_name(case_name(path.stem) + path.suffix)
            if path.suffix == ".json":
                meta = json.loads(path.read_text(encoding="utf-8"))
                renamed.parent.mkdir(parents=True, exist_ok=True)
                renamed.write_text(json.dumps(dict(meta, case=case_name(path.stem)), indent=1), encoding="utf-8")
            else:
                _link(path, renamed)
        elif path.name == "hift.pt" and path.parent.name == "model":
            out.parent.mkdir(parents=True, exist_ok=True)
            torch.save(legacy_hift(torch.load(path, map_location="cpu", weights_only=True)), out)
        elif path.parent == front and path.name == "manifest.json":
            out.parent.mkdir(parents=True, exist_ok=True)
            kept = {k: v for k, v in clips.items() if k != shortest}
            out.write_text(json.dumps(dict(manifest, clips=kept), indent=1), encoding="utf-8")
        elif path.parent.parent == front and path.parent.name in ("audio", "refs") and path.name in dropped:
            continue
        elif any(part.startswith(".") for part in rel.parts):
            continue  # caches another run wrote beside the fixtures
        else:
            _link(path, out)
    return dest


def main(argv: list[str] | None = None) -> None:
    """Command line: derive SRC's second tree into DEST (replaced if it is a derived tree already)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("dest", type=Path)
    args = parser.parse_args(argv)
    if args.dest.exists() and (args.dest / "frontend" / "manifest.json").is_file():
        shutil.rmtree(args.dest)
    derive(args.src.resolve(), args.dest)
    print(f"derived fixture tree: {args.dest} (from {args.src}; {sum(1 for _ in args.dest.rglob('*'))} entries)")


if __name__ == "__main__":
    main()

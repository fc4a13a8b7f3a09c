"""Discovering and loading the CosyVoice parity cases (`cosyvoice/<version>/cases/<case>.json`).

A case manifest is a json naming its model dir (`model_dir_relative_to_this_file`) and its
tensor file; other jsons there (e.g. construction noise) are not cases. Tensors stored once
for several names are resolved through the manifest's `aliases`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from mizuoto.testing.fixtures import Recording, fixtures_root, load_tensors, read_manifest


@dataclass(frozen=True)
class CaseRef:
    """Where a case is (version folder, case name, manifest path) and which tensors it lists."""

    version: str
    name: str
    json_path: Path
    model_dir: Path
    tensor_names: frozenset[str] = frozenset()

    @property
    def id(self) -> str:
        """A test id such as `v2-zero_shot`."""
        return f"{self.version}-{self.name}"

    def has(self, *names: str) -> bool:
        """Whether the manifest lists every one of these tensors (aliases included)."""
        return all(n in self.tensor_names for n in names)

    @property
    def yaml_path(self) -> Path:
        """The model dir's cosyvoice*.yaml."""
        found = sorted(self.model_dir.glob("cosyvoice*.yaml"))
        if len(found) != 1:
            raise FileNotFoundError(f"{self.model_dir}: expected one cosyvoice*.yaml, found {len(found)}")
        return found[0]


@dataclass
class Case(Recording):
    """A loaded parity case (`meta`, `tensors`) and where it is (`ref`)."""

    ref: CaseRef = field(kw_only=True)

    @property
    def model_dir(self) -> Path:
        """The upstream-format model directory the case was recorded with."""
        return self.ref.model_dir

    @property
    def seed(self) -> int:
        """The seed upstream's `set_all_random_seed` got right before the call."""
        return int(self.meta["seed"])

    def input(self, key: str) -> torch.Tensor | None:
        """The model.tts kwarg `key` (stored as `input.<key>`), or None if the case has none."""
        return self.tensors.get(f"input.{key}")


def _manifest(path: Path) -> dict[str, Any] | None:
    return read_manifest(path, "model_dir_relative_to_this_file", "tensor_file")


def _ref(path: Path, meta: dict[str, Any]) -> CaseRef:
    names = frozenset(meta.get("tensors", {})) | frozenset(meta.get("aliases", {}))
    model_dir = (path.parent / meta["model_dir_relative_to_this_file"]).resolve()
    return CaseRef(meta.get("version", path.parent.parent.name), meta.get("case", path.stem),
                   path, model_dir, names)


def list_cases(root: Path | None = None) -> list[CaseRef]:
    """Every case under `<root>/cosyvoice/*/cases/` (root: the fixtures), sorted by path."""
    base = (root or fixtures_root()) / "cosyvoice"
    refs = []
    for path in sorted(base.glob("*/cases/*.json")):
        meta = _manifest(path)
        if meta is not None:
            refs.append(_ref(path, meta))
    return refs


def load_case(ref: CaseRef | Path) -> Case:
    """A case's manifest and tensors (from its json path or its CaseRef)."""
    path = ref if isinstance(ref, Path) else ref.json_path
    meta = _manifest(path)
    if meta is None:
        raise ValueError(f"{path} is not a case manifest")
    return Case(meta, load_tensors(path, meta), ref=_ref(path, meta))


def assemble_model_dir(model_dir: Path, dest: Path) -> Path:
    """A complete model directory in `dest`: the fixture model plus the front-end files it lacks.

    Fixture model dirs hold only the yaml and llm/flow/hift; a real directory also holds the
    speech tokenizer and CAM++ ONNX files (here the fixtures' random-weight ones), the
    CosyVoice-BlankEN tokenizer files (v2/v3). Files are
    symlinked, so caches written beside them land in `dest`, never in the fixture tree.
    """
    from mizuoto.testing.fixtures import asset_path

    dest.mkdir(parents=True, exist_ok=True)
    for item in model_dir.iterdir():
        if item.name == "CosyVoice-BlankEN":
            (dest / item.name).mkdir(exist_ok=True)
            for f in item.iterdir():
                _link(f, dest / item.name / f.name)
        elif not item.name.startswith("."):
            _link(item, dest / item.name)
    models = fixtures_root() / "frontend" / "models"
    for onnx in sorted(models.glob("*.onnx")):
        _link(onnx, dest / onnx.name)
    blank_en = dest / "CosyVoice-BlankEN"
    if blank_en.is_dir():
        for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
            _link(asset_path("cosyvoice", "CosyVoice-BlankEN", name), blank_en / name)
    # v1's Whisper vocabulary is a shared resource (not in a model dir): found as on a user's install
    return dest


def _link(src: Path, dst: Path) -> None:
    if not dst.exists():
        dst.symlink_to(src.resolve())


# -- streamed text in (upstream's bistream) ------------------------------------------------------
def bistream_text(text: torch.Tensor, prompt_text: torch.Tensor, prompt_tokens: int, piece: int,
                  mix_ratio: tuple[int, int]) -> torch.Tensor:
    """`text` repeated until it outlasts the reference in upstream's bistream.

    The LM speaks only once every prompt speech token went in (`mix_ratio`, the LM's text tokens in
    per prompt speech tokens in, the reference text counting as text); text that ends before that
    all goes to the final loop, where eos may come first. So a longer reference needs more text:
    three pieces more than that, and at least 3 times.
    """
    text_in, speech_in = mix_ratio
    needed = text_in * (-(-prompt_tokens // speech_in)) + text_in - prompt_text.shape[1] + 3 * piece
    return text.repeat(1, max(3, -(-needed // text.shape[1]) + 1))


def first_speaking_seed(attempt: Callable[[int], Any], start: int, tries: int = 16) -> tuple[int, Any]:
    """(seed, result) of the first seed from `start` whose `attempt(seed)` gives a truthy result.

    A random-weight LM may stop at once (eos first) or draw a special token upstream rejects too
    (a MizuotoError naming it): neither says anything about the property a test wants to see. If
    no seed of `tries` speaks, (start, what `start` gave: the error or the empty result), so the
    caller checks that upstream's outcome is what Mizuoto gives instead.
    """
    from mizuoto.errors import MizuotoError

    first: Any = None
    for seed in range(start, start + tries):
        try:
            result = attempt(seed)
        except MizuotoError as exc:
            if "special token" not in str(exc):
                raise
            result = exc
        if seed == start:
            first = result
        if result and not isinstance(result, MizuotoError):
            return seed, result
    return start, first

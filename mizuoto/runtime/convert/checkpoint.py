"""One checkpoint matcher for every foreign format: declared key maps, named transposes and folds.

A loader names, for every key of its module's state_dict, where the value comes from: a source
tensor (`Src`, optionally transposed), or several combined by a named function (`Fold`, e.g.
weight norm's g and v). `match_state_dict` asserts the map is one to one: every target key has a
source that exists, every source tensor is used exactly once (or declared ignored), every shape
matches. All problems are gathered into one error line, in one format, whatever the format of the
file: an ONNX graph (`convert/onnx.py`) or a `.pt` state dict (`read_checkpoint`, `DictSource`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mizuoto.errors import ModelLoadError

_SHOWN = 5  # names listed per problem before "(+N more)"


@dataclass(frozen=True)
class Src:
    """A target value taken from one source tensor, transposed when the source stores it [in, out]."""

    name: str
    transpose: bool = False


@dataclass(frozen=True)
class Fold:
    """A target value computed from several source tensors by `fn` (named in `what`, e.g. "weight norm")."""

    sources: tuple[str, ...]
    fn: Callable[..., torch.Tensor]
    what: str


class DictSource(dict):
    """A `.pt` state dict as a tensor source (an OnnxGraph is the other): names, has_tensor, tensor, root."""

    names = dict.keys
    has_tensor = dict.__contains__
    tensor = dict.__getitem__

    def root(self, name: str) -> str:
        """Names have no aliases in a state dict."""
        return name


def few(names: list[str]) -> str:
    """The first few names, then how many more."""
    return ", ".join(names[:_SHOWN]) + (f" (+{len(names) - _SHOWN} more)" if len(names) > _SHOWN else "")


def _shape(t: torch.Tensor | torch.Size | tuple) -> tuple[int, ...]:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else tuple(t)


def match_state_dict(source: Any, key_map: Mapping[str, Src | Fold | str],
                     shapes: Mapping[str, torch.Size | tuple[int, ...]], *, where: str | Path, target: str,
                     ignore: Iterable[str] = ()) -> dict[str, torch.Tensor]:
    """Fill every key of `shapes` from the `source` tensors `key_map` names; any mismatch is one ModelLoadError.

    `source` has names(), has_tensor(name), tensor(name) and root(name) (aliases followed). `target` names what the file should fit (e.g. "the yaml's flow"); `ignore` lists source
    tensors that are read some other way (config values, a tied head checked by the caller).
    """
    problems: list[str] = []
    unmapped = [k for k in shapes if k not in key_map]
    if unmapped:
        problems.append(f"no source for {few(unmapped)}")
    unknown = [k for k in key_map if k not in shapes]
    if unknown:
        problems.append(f"the key map names unknown keys {few(unknown)}")
    used: dict[str, str] = {}
    twice: list[str] = []
    missing: list[str] = []
    wrong: list[str] = []
    out: dict[str, torch.Tensor] = {}
    for key, spec in key_map.items():
        if key not in shapes:
            continue
        spec = Src(spec) if isinstance(spec, str) else spec
        names = spec.sources if isinstance(spec, Fold) else (spec.name,)
        for name in names:
            # by name: a deduplicated ONNX file lets two names alias one stored tensor
            if name in used:
                twice.append(f"{name} mapped twice (for {used[name]} and {key})")
        absent = [n for n in names if not source.has_tensor(n)]
        if absent:  # the present ones of a fold stay unconsumed, so they are named too
            missing += absent
            continue
        used.update((name, key) for name in names)
        if isinstance(spec, Fold):
            value = spec.fn(*(source.tensor(n) for n in names))
            origin = f"{spec.what} of {' and '.join(names)}"
        else:
            value = source.tensor(spec.name)
            origin = spec.name
            if spec.transpose:
                if value.dim() != 2:
                    wrong.append(f"{spec.name} for {key} is not a matrix (shape {_shape(value)})")
                    continue
                value = value.t().contiguous()
                origin = f"{spec.name} (transposed)"
        if _shape(value) != _shape(shapes[key]):
            wrong.append(f"{origin} has shape {_shape(value)}, expected {_shape(shapes[key])} for {key}")
            continue
        out[key] = value
    consumed = {source.root(n) for n in [*used, *ignore]}
    unexpected = [n for n in source.names() if n not in consumed]
    if missing:
        problems.append(f"missing keys: {few(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {few(unexpected)}")
    problems += twice[:1] + wrong[:_SHOWN]
    if problems:
        raise ModelLoadError(f"{where} does not match {target}: " + "; ".join(problems))
    assert len(out) == len(shapes), (len(out), len(shapes))
    return out


def read_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """A `.pt` file of named tensors (torch.load, weights only, on the CPU); any failure is one clear line."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"checkpoint missing: {path} not found")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or foreign file fails in many ways inside torch.load
        raise ModelLoadError(f"cannot read {path}: {type(exc).__name__}: {' '.join(str(exc).split())}") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ModelLoadError(f"cannot read {path}: it is not a state dict of tensors")
    return dict(state)


def load_checkpoint(module: torch.nn.Module, path: str | Path, key_map: Mapping[str, Src | Fold | str] | None = None,
                    *, target: str, ignore: Iterable[str] = (),
                    state: Mapping[str, torch.Tensor] | None = None) -> torch.nn.Module:
    """Load a `.pt` file (or its already read `state`) into `module` through `key_map` (default: same names)."""
    if state is None:
        state = read_checkpoint(path)
    shapes = {k: v.shape for k, v in module.state_dict().items()}
    matched = match_state_dict(DictSource(state), key_map if key_map is not None else {k: k for k in shapes},
                               shapes, where=path, target=target, ignore=ignore)
    module.load_state_dict(matched, strict=True)
    return module

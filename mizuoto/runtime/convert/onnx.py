"""ONNX weights -> torch state_dicts, by explicit key maps, converted once and cached as safetensors.

A block reads an `OnnxGraph` (initializers, Constant-node tensors, Identity aliases and nodes),
derives its sizes from it and names, for every key of its state_dict, the graph tensor that
fills it (`Src`). `extract_state_dict` checks the map (checkpoint.py's matcher, shared with `.pt` files); `load_converted` caches the result at
`<model>/.mizuoto/converted-<key>.safetensors` (the key hashes the ONNX bytes, the converter's
version and the block's layout version), prefers `<name>.safetensors` beside the ONNX file, and
rebuilds a cache file it cannot verify.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import numpy as np
import torch

from mizuoto import progress as progress_lines
from mizuoto.files import atomic_path
from mizuoto.runtime.convert.checkpoint import Src, match_state_dict
from mizuoto.runtime.assets import model_cache_dir
from mizuoto.errors import ModelLoadError

CONVERTER_VERSION = "1"
_log = logging.getLogger("mizuoto.convert")

# progress(stage, done, total): stage "hash" or "parse" (bytes of the ONNX file) or "write" (steps).
Progress = Callable[[str, int, int], None]
# A block's conversion: graph -> (config of plain JSON values, state_dict).
Converter = Callable[["OnnxGraph"], "tuple[dict, dict[str, torch.Tensor]]"]

_META_FORMAT = "mizuoto.format"
_META_KEY = "mizuoto.key"
_META_CONFIG = "mizuoto.config"
_META_DIGEST = "mizuoto.digest"
_FORMAT = "mizuoto-onnx-converted"
_CHUNK = 1 << 22
_LARGE = 64 << 20


def _log_progress(stage: str, done: int, total: int) -> None:
    if progress_lines.enabled():  # the command line asked for progress lines (mizuoto.progress)
        stderr_progress(stage, done, total)
    elif total >= _LARGE and done == total:
        _log.info("%s: %d MiB done", stage, total >> 20)


def stderr_progress(stage: str, done: int, total: int) -> None:
    """A progress callback for the CLI: one updating stderr line per stage of a large file."""
    if total < _LARGE:
        return
    end = "\n" if done >= total else ""
    print(f"\r{_STAGE_WORDS.get(stage, stage)} {done >> 20}/{total >> 20} MiB", end=end,
          file=sys.stderr, flush=True)


_STAGE_WORDS = {"hash": "checking ONNX file", "parse": "reading ONNX file"}


def _say_write(done: int) -> None:
    """The conversion's last step, reported where progress lines are on (any file size)."""
    (progress_lines.update if not done else progress_lines.line)(
        "converting ONNX weights to torch: writing the cache" + (" ... done" if done else " ..."))


class OnnxGraph:
    """A read-only view of one ONNX model: its named tensors and its nodes."""

    def __init__(self, path: Path, model) -> None:
        from onnx import numpy_helper

        self.path = path
        graph = model.graph
        self.nodes = list(graph.node)
        self.node_by_name = {n.name: n for n in self.nodes if n.name}
        self.initializers = {t.name: t for t in graph.initializer}
        self._constants: dict[str, object] = {}
        self._alias: dict[str, str] = {}
        self.consumers: dict[str, list] = {}
        self._producer = {out: n for n in self.nodes for out in n.output}
        for node in self.nodes:
            for name in node.input:
                self.consumers.setdefault(name, []).append(node)
            if node.op_type == "Constant":
                for attr in node.attribute:
                    if attr.name == "value":
                        self._constants[node.output[0]] = attr.t
            elif node.op_type == "Identity" and node.input:
                self._alias[node.output[0]] = node.input[0]
        self._to_array = numpy_helper.to_array
        self.inputs = {v.name: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim]
                       for v in graph.input}

    def root(self, name: str) -> str:
        """The initializer or Constant output that `name` names, following Identity aliases."""
        seen = 0
        while name in self._alias and seen < 64:
            name, seen = self._alias[name], seen + 1
        return name

    def names(self) -> list[str]:
        """The stored weights (initializers): each must be used by a key map or read as config."""
        return list(self.initializers)

    def has_tensor(self, name: str) -> bool:
        """True when `name` is an initializer, a Constant output, or an alias of one."""
        root = self.root(name)
        return root in self.initializers or root in self._constants

    def _proto(self, name: str):
        root = self.root(name)
        proto = self.initializers.get(root) or self._constants.get(root)
        if proto is None:
            raise ModelLoadError(f"{self.path}: no tensor named {name!r}")
        return proto

    def array(self, name: str) -> np.ndarray:
        """The value of a named tensor as a numpy array."""
        return np.array(self._to_array(self._proto(name)))

    def tensor(self, name: str) -> torch.Tensor:
        """The value of a named tensor as a torch tensor (a copy)."""
        return torch.from_numpy(np.ascontiguousarray(self.array(name)))

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of a named tensor, without materializing it."""
        return tuple(int(d) for d in self._proto(name).dims)

    def node(self, name: str):
        """The node called `name`, or a ModelLoadError naming the file and the node."""
        node = self.node_by_name.get(name)
        if node is None:
            raise ModelLoadError(f"{self.path}: expected node {name!r} not found")
        return node

    def producer(self, name: str):
        """The node that outputs `name`, or None for graph inputs and initializers."""
        return self._producer.get(name)

    def find(self, op_type: str | None = None, prefix: str = "") -> list:
        """Nodes (in graph order) of an op type whose name starts with `prefix`."""
        return [n for n in self.nodes
                if (op_type is None or n.op_type == op_type) and n.name.startswith(prefix)]

    def tensor_inputs(self, node) -> list[str]:
        """The inputs of `node` that are tensors of the graph (weights or folded constants)."""
        return [name for name in node.input if name and self.has_tensor(name)]

    def attr(self, node, name: str, default=None):
        """A node attribute's value, or `default`."""
        from onnx import helper

        for attr in node.attribute:
            if attr.name == name:
                return helper.get_attribute_value(attr)
        return default


def _parse_onnx(path: Path, progress: Progress) -> OnnxGraph:
    import onnx

    size = path.stat().st_size
    progress("parse", 0, size)
    try:
        model = onnx.load(str(path))
    except Exception as e:  # protobuf raises several unrelated types on bad bytes
        raise ModelLoadError(f"{path}: not a readable ONNX file ({type(e).__name__}: {e})") from None
    if len(model.graph.node) == 0:
        raise ModelLoadError(f"{path}: not a readable ONNX file (empty graph)")
    progress("parse", size, size)
    return OnnxGraph(path, model)


def load_graph(path: str | Path, progress: Progress | None = None) -> OnnxGraph:
    """Parse an ONNX file; an unreadable one is a ModelLoadError naming it."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"{path}: ONNX file not found")
    return _parse_onnx(path, progress or _log_progress)


def extract_state_dict(graph: OnnxGraph, key_map: Mapping[str, Src | str],
                       shapes: Mapping[str, tuple[int, ...] | torch.Size],
                       read_as_config: Iterable[str] = ()) -> dict[str, torch.Tensor]:
    """Fill every key of `shapes` from the graph tensor `key_map` names (checkpoint.match_state_dict's rules).

    Every initializer of the file must be consumed by the map or listed in `read_as_config`.
    """
    return match_state_dict(graph, key_map, shapes, where=graph.path, target="the block's layout",
                            ignore=read_as_config)


def _hash_file(path: Path, progress: Progress) -> str:
    size = path.stat().st_size
    digest = hashlib.sha256()
    done = 0
    progress("hash", 0, size)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            done += len(chunk)
            if done % (_CHUNK * 16) == 0:
                progress("hash", done, size)
    progress("hash", size, size)
    return digest.hexdigest()


def _tensor_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for key in sorted(tensors):
        t = tensors[key].detach().cpu().contiguous()
        digest.update(f"{key}:{t.dtype}:{tuple(t.shape)};".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def cache_key(onnx_path: str | Path, layout: str, progress: Progress | None = None) -> str:
    """The cache key of an ONNX file for a block layout: its bytes, the converter's and the layout's version."""
    file_hash = _hash_file(Path(onnx_path), progress or _log_progress)
    mixed = hashlib.sha256(f"{file_hash}|{CONVERTER_VERSION}|{layout}".encode()).hexdigest()
    return mixed[:24]


def cache_path(onnx_path: str | Path, key: str) -> Path:
    """`<model>/.mizuoto/converted-<key>.safetensors` ($MIZUOTO_HOME when the model dir is read-only)."""
    return model_cache_dir(Path(onnx_path).parent) / f"converted-{key}.safetensors"


def _read_safetensors(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(metadata, tensors) of a safetensors file."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.metadata() or {}, {k: f.get_tensor(k) for k in f.keys()}


def _read_verified(path: Path, key: str | None) -> tuple[dict, dict[str, torch.Tensor]] | None:
    """(config, tensors) of a file we wrote, or None when it is truncated, foreign or stale."""
    try:
        meta, tensors = _read_safetensors(path)
        if meta.get(_META_FORMAT) != _FORMAT or (key is not None and meta.get(_META_KEY) != key):
            return None
        if _tensor_digest(tensors) != meta.get(_META_DIGEST):
            return None
        return json.loads(meta[_META_CONFIG]), tensors
    except Exception:  # any unreadable file is simply not a valid cache
        return None


def _write(path: Path, key: str, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    tensors = {k: v.contiguous() for k, v in tensors.items()}
    meta = {_META_FORMAT: _FORMAT, _META_KEY: key, _META_CONFIG: json.dumps(config, sort_keys=True),
            _META_DIGEST: _tensor_digest(tensors)}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=meta)


def _read_beside(path: Path) -> tuple[dict | None, dict[str, torch.Tensor]]:
    try:
        meta, tensors = _read_safetensors(path)
    except Exception as e:
        raise ModelLoadError(f"{path}: not a readable safetensors file ({e})") from None
    config = json.loads(meta[_META_CONFIG]) if _META_CONFIG in meta else None
    return config, tensors


def load_converted(onnx_path: str | Path, convert: Converter, layout: str,
                   progress: Progress | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, state_dict) of an ONNX file for a block, converting it at most once.

    Order: `<name>.safetensors` beside the ONNX file (config from its metadata, else from the
    graph); then a verified cache file; else parse, convert, and write the cache atomically.
    `layout` names the block's key layout; bump it when the block's key map changes.
    """
    onnx_path = Path(onnx_path)
    progress = progress or _log_progress
    if not onnx_path.is_file():
        raise ModelLoadError(f"{onnx_path}: ONNX file not found")
    beside = onnx_path.with_suffix(".safetensors")
    if beside.is_file():
        config, tensors = _read_beside(beside)
        if config is None:
            config, _ = convert(load_graph(onnx_path, progress))
        return config, tensors
    key = cache_key(onnx_path, layout, progress)
    cached = cache_path(onnx_path, key)
    if cached.is_file():
        hit = _read_verified(cached, key)
        if hit is not None:
            return hit
        _log.warning("%s: cache file is invalid, rebuilding it", cached)
    graph = load_graph(onnx_path, progress)
    config, tensors = convert(graph)
    progress("write", 0, 1)
    _say_write(0)
    _write(cached, key, config, tensors)
    progress("write", 1, 1)
    _say_write(1)
    return config, tensors


def load_into(module: torch.nn.Module, state: Mapping[str, torch.Tensor], onnx_path: str | Path) -> None:
    """Load converted weights strictly; a mismatch names the file they came from."""
    onnx_path = Path(onnx_path)
    beside = onnx_path.with_suffix(".safetensors")
    source = beside if beside.is_file() else onnx_path
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as e:
        first = str(e).strip().splitlines()
        raise ModelLoadError(f"{source}: weights do not fit {type(module).__name__} "
                             f"({' '.join(line.strip() for line in first[:3])})") from None

"""Load options (device, precision, compute switches), and the one parser of them every command uses.

Unknown keys and bad values are errors. Importing this module is cheap (torch is imported when a
device is checked), so a command can build its parser without loading torch.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from mizuoto.errors import InvalidRequest

PRECISIONS = ("fp32", "fp16")
# "auto": static for a batched model (its rows' caches are allocated once, at the request's bound, which
# admission reserves anyway, instead of eight caches growing by concatenation in the heap: docs/memory.md),
# dynamic (upstream's layout) for one request at a time; both give the same tokens
KV_CACHES = ("auto", "dynamic", "static")
# How a new reference clip is analysed: in the reference implementation's float order (the same
# numbers; CosyVoice's CAM++ as onnxruntime computes it, ~1 s a new voice) or with torch's kernels.
REFERENCE_ORDERS = ("exact", "fast")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _flag(key: str, value: Any) -> bool:
    """A boolean option given as a bool or as the usual words (the CLI passes strings)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    raise InvalidRequest(f"option {key} must be true or false, got {value!r}")


def _choice(key: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise InvalidRequest(f"option {key} must be one of {', '.join(choices)}, got {value!r}")
    return value


@dataclass(frozen=True)
class ComputeOptions:
    """How the heavy parts run: KV cache layout, CUDA graphs, torch.compile, LM batch width, reference analysis."""

    kv_cache: str = "auto"  # resolved at construction: "auto" never reaches an engine
    cuda_graphs: bool = False
    compile: bool = False
    batch: int = 1  # requests whose LM steps share one batched step (1: one at a time, upstream's exact path)
    reference: str = "exact"  # REFERENCE_ORDERS: how a new voice's reference clip is analysed

    def __post_init__(self) -> None:
        _choice("compute.kv_cache", self.kv_cache, KV_CACHES)
        _choice("compute.reference", self.reference, REFERENCE_ORDERS)
        try:
            batch = int(self.batch)
        except (TypeError, ValueError):
            batch = 0
        if isinstance(self.batch, bool) or batch < 1 or str(batch) != str(self.batch).strip():
            raise InvalidRequest(f"option compute.batch must be a whole number >= 1, got {self.batch!r}")
        object.__setattr__(self, "batch", batch)
        if self.kv_cache == "auto":
            object.__setattr__(self, "kv_cache", "static" if batch > 1 else "dynamic")
        object.__setattr__(self, "cuda_graphs", _flag("compute.cuda_graphs", self.cuda_graphs))
        object.__setattr__(self, "compile", _flag("compute.compile", self.compile))


@dataclass(frozen=True)
class LoadOptions:
    """Options of one model load. `device="auto"` means CUDA when available, else the CPU."""

    device: str = "auto"
    precision: str = "fp32"
    compute: ComputeOptions = field(default_factory=ComputeOptions)
    # engines whose upstream marks its output (Chatterbox's Perth watermark) skip the mark when False
    watermark: bool = True

    def __post_init__(self) -> None:
        _choice("precision", self.precision, PRECISIONS)
        object.__setattr__(self, "watermark", _flag("watermark", self.watermark))
        if not isinstance(self.device, str):
            raise InvalidRequest(f"option device must be a string, got {self.device!r}")
        if self.device != "auto":
            import torch

            try:
                torch.device(self.device)
            except (RuntimeError, ValueError):
                raise InvalidRequest(f"option device: not a device name: {self.device!r}") from None

    def resolved(self) -> LoadOptions:
        """The same options with `auto` replaced by a concrete device; an unavailable device is an error."""
        import torch

        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        kind = torch.device(device).type
        if kind == "cuda" and not torch.cuda.is_available():
            raise InvalidRequest(f"option device={device}: CUDA is not available on this machine")
        if kind == "mps" and not torch.backends.mps.is_available():
            raise InvalidRequest(f"option device={device}: MPS is not available on this machine")
        return replace(self, device=device)

    def as_dict(self) -> dict[str, Any]:
        """The options as keyword arguments of `Runtime.load` (and `parse_options`)."""
        return {"device": self.device, "precision": self.precision, "compute": asdict(self.compute),
                "watermark": self.watermark}


_COMPUTE_KEYS = tuple(f.name for f in fields(ComputeOptions))
KNOWN_KEYS = ("device", "precision", "watermark", *(f"compute.{k}" for k in _COMPUTE_KEYS))


def parse_options(options: Mapping[str, Any] | None = None, **kwargs: Any) -> LoadOptions:
    """LoadOptions from keys like `device`, `compute.kv_cache`, `compute_kv_cache` or `compute={...}`."""
    flat: dict[str, Any] = {}
    for key, value in {**(options or {}), **kwargs}.items():
        if key == "compute" and isinstance(value, Mapping):
            items = {f"compute.{k}": v for k, v in value.items()}
        else:
            items = {key.replace("compute_", "compute.", 1) if key.startswith("compute_") else key: value}
        for k, v in items.items():
            if k not in KNOWN_KEYS:
                raise InvalidRequest(f"unknown option {k!r}; known options: {', '.join(KNOWN_KEYS)}")
            flat[k] = v
    compute = ComputeOptions(**{k: flat[f"compute.{k}"] for k in _COMPUTE_KEYS if f"compute.{k}" in flat})
    top = {k: flat[k] for k in ("device", "precision", "watermark") if k in flat}
    return LoadOptions(compute=compute, **top)


# --- the command-line parser of load options ---------------------------------------------------

_ENV = {"device": "MIZUOTO_DEVICE", "precision": "MIZUOTO_PRECISION", "option": "MIZUOTO_OPTIONS"}


def add_load_arguments(parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """Add --device, --precision and --option KEY=VALUE to `parser`.

    With `environ` (e.g. os.environ), MIZUOTO_DEVICE, MIZUOTO_PRECISION and MIZUOTO_OPTIONS
    (KEY=VALUE items separated by spaces) give the defaults; a flag given on the command line wins.
    """
    env = environ if environ is not None else {}
    tag = (lambda key: f" [{_ENV[key]}]") if environ is not None else (lambda key: "")
    parser.add_argument("--device", default=env.get(_ENV["device"]) or None,
                        help="cpu, cuda, cuda:1, mps (default: auto, which is cuda when a GPU is present,"
                             f" else cpu){tag('device')}")
    parser.add_argument("--precision", default=env.get(_ENV["precision"]) or None,
                        help=f"{' or '.join(PRECISIONS)} (default: {LoadOptions.precision}){tag('precision')}")
    parser.add_argument("--option", action="append", metavar="KEY=VALUE",
                        default=env.get(_ENV["option"], "").split() or None,
                        help=f"load option, repeatable; keys: {', '.join(KNOWN_KEYS)}{tag('option')}")


def options_from_args(args: argparse.Namespace, defaults: Mapping[str, Any] | None = None) -> LoadOptions:
    """The LoadOptions of parsed --option KEY=VALUE, --device and --precision (the flags win over --option).

    `defaults` (keys as in --option) apply where the command line does not give the key.
    """
    options: dict[str, Any] = dict(defaults or {})
    for item in getattr(args, "option", None) or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise InvalidRequest(f"--option takes KEY=VALUE, got {item!r}")
        options[key.strip()] = value.strip()
    for key in ("device", "precision"):
        if getattr(args, key, None) is not None:
            options[key] = getattr(args, key)
    return parse_options(options)

"""Load options: device, precision and compute switches; unknown keys and bad values are errors."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from mizuoto.errors import InvalidRequest

PRECISIONS = ("fp32", "fp16")
KV_CACHES = ("dynamic", "static")
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
    """How the heavy parts run: KV cache layout, CUDA graphs, torch.compile."""

    kv_cache: str = "dynamic"
    cuda_graphs: bool = False
    compile: bool = False

    def __post_init__(self) -> None:
        _choice("compute.kv_cache", self.kv_cache, KV_CACHES)
        object.__setattr__(self, "cuda_graphs", _flag("compute.cuda_graphs", self.cuda_graphs))
        object.__setattr__(self, "compile", _flag("compute.compile", self.compile))


@dataclass(frozen=True)
class LoadOptions:
    """Options of one model load. `device="auto"` means CUDA when available, else the CPU."""

    device: str = "auto"
    precision: str = "fp32"
    compute: ComputeOptions = field(default_factory=ComputeOptions)

    def __post_init__(self) -> None:
        _choice("precision", self.precision, PRECISIONS)
        if not isinstance(self.device, str):
            raise InvalidRequest(f"option device must be a string, got {self.device!r}")
        if self.device != "auto":
            try:
                torch.device(self.device)
            except (RuntimeError, ValueError):
                raise InvalidRequest(f"option device: not a device name: {self.device!r}") from None

    def resolved(self) -> LoadOptions:
        """The same options with `auto` replaced by a concrete device; an unavailable device is an error."""
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        kind = torch.device(device).type
        if kind == "cuda" and not torch.cuda.is_available():
            raise InvalidRequest(f"option device={device}: CUDA is not available on this machine")
        if kind == "mps" and not torch.backends.mps.is_available():
            raise InvalidRequest(f"option device={device}: MPS is not available on this machine")
        return replace(self, device=device)


_COMPUTE_KEYS = tuple(f.name for f in fields(ComputeOptions))
KNOWN_KEYS = ("device", "precision", *(f"compute.{k}" for k in _COMPUTE_KEYS))


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
    top = {k: flat[k] for k in ("device", "precision") if k in flat}
    return LoadOptions(compute=compute, **top)


def load_options(args: Any) -> dict:
    """Load options from --option KEY=VALUE, --device and --precision (unknown keys fail later, in parse_options)."""
    options = {}
    for item in args.option or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise InvalidRequest(f"--option takes KEY=VALUE, got {item!r}")
        options[key.strip()] = value.strip()
    for key in ("device", "precision"):
        if getattr(args, key, None) is not None:
            options[key] = getattr(args, key)
    return options

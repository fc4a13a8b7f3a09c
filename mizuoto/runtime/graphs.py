"""CUDA-graph capture and replay, engine-neutral; everywhere else a logged no-op.

A captured callable reads fixed ("static") input tensors and writes fixed output tensors, so
a call copies its inputs into the static buffers, replays the graph and returns the static
outputs (overwritten by the next call). Off CUDA, or where capture is unavailable, the same
object just calls the function: code written against it runs everywhere.

Random draws inside a graph use a private generator registered with the graph. Before every
replay it takes the caller's generator state and afterwards hands the advanced state back,
so a replay draws exactly what an eager call on the caller's generator would, and eager draws
between replays (e.g. a streaming flow's noise) see the same generator as without graphs.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch

log = logging.getLogger(__name__)

Tensors = Any  # a tensor or a (nested) tuple/list of tensors


def unavailable_reason(device: torch.device | str) -> str | None:
    """Why CUDA graphs cannot run on `device`, or None when they can."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"CUDA graphs need an NVIDIA CUDA device; this runs on {device.type}"
    if not torch.cuda.is_available():
        return "CUDA graphs need CUDA, which is not available in this torch build or machine"
    if torch.version.hip is not None:
        return "CUDA graphs are enabled on NVIDIA devices only (this is a ROCm build)"
    return None


def use_cuda_graphs(requested: bool, device: torch.device | str, what: str = "the model",
                    why_not: str | None = None) -> bool:
    """Whether to capture: `requested` and possible; when requested but not possible, log why.

    `why_not` lets the caller add its own reason (e.g. "the LM is not fully on the device").
    """
    if not requested:
        return False
    reason = why_not or unavailable_reason(device)
    if reason is not None:
        log.warning("compute.cuda_graphs is on but has no effect for %s: %s; running eagerly", what, reason)
        return False
    return True


def new_pool(device: torch.device | str | None = None) -> Any | None:
    """A memory-pool handle that several graphs can share (None off CUDA)."""
    if device is not None and unavailable_reason(device) is not None:
        return None
    return torch.cuda.graph_pool_handle()


def _map(fn: Callable[[torch.Tensor], Any], x: Tensors) -> Any:
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (tuple, list)):
        return type(x)(_map(fn, y) for y in x)
    if x is None:
        return None
    raise TypeError(f"a captured function may only return tensors, got {type(x).__name__}")


class GraphedCallable:
    """`fn(*inputs[, generator])` as one CUDA graph over static buffers; eager where graphs can't run.

    `example_inputs` become the static input buffers (cloned unless `inputs_are_static`).
    `fn` must be safe to run a few extra times (it runs `warmup` times before capture).
    `random=True` passes a generator as the last argument (the private one when captured).
    """

    def __init__(self, fn: Callable[..., Tensors], example_inputs: Sequence[torch.Tensor], *,
                 enabled: bool = True, random: bool = False, warmup: int = 2, pool: Any | None = None,
                 inputs_are_static: bool = False, name: str = "graph") -> None:
        self.fn, self.random, self.name = fn, random, name
        self.graph: Any | None = None
        self.outputs: Tensors = None
        self.generator: torch.Generator | None = None
        device = example_inputs[0].device if example_inputs else torch.device("cpu")
        self.reason = "disabled" if not enabled else unavailable_reason(device)
        if self.reason is not None:
            self.inputs = list(example_inputs)
            log.debug("%s runs eagerly: %s", name, self.reason)
            return
        self.inputs = list(example_inputs) if inputs_are_static else [x.clone() for x in example_inputs]
        try:
            self._capture(device, warmup, pool)
        except Exception as exc:  # an op that cannot be captured: same results, eagerly
            self.graph, self.outputs, self.generator = None, None, None
            self.reason = f"capture failed ({type(exc).__name__}: {exc})"
            log.warning("%s runs eagerly: %s", name, self.reason)

    @property
    def captured(self) -> bool:
        """Whether calls replay a CUDA graph."""
        return self.graph is not None

    def _args(self) -> list[Any]:
        return [*self.inputs, self.generator] if self.random else list(self.inputs)

    def _capture(self, device: torch.device, warmup: int, pool: Any | None) -> None:
        if self.random:
            self.generator = torch.Generator(device=device)
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # lazy initialization (cuBLAS handles, workspaces) happens here
            for _ in range(warmup):
                self.fn(*self._args())
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self.generator is not None:
            graph.register_generator_state(self.generator)
        # thread_local: other threads (other requests, other models' batch loops) keep using the
        # device while this one captures; "global" would make their CUDA calls fail meanwhile
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            self.outputs = self.fn(*self._args())
        _map(lambda t: t, self.outputs)  # refuse anything but tensors: only they are static
        self.graph = graph

    def __call__(self, *inputs: torch.Tensor, generator: torch.Generator | None = None) -> Tensors:
        """Run on `inputs` (drawing from `generator`, else the device's default generator)."""
        if self.graph is None:
            return self.fn(*inputs, generator) if self.random else self.fn(*inputs)
        if len(inputs) != len(self.inputs):
            raise TypeError(f"{self.name}: expected {len(self.inputs)} inputs, got {len(inputs)}")
        for static, x in zip(self.inputs, inputs):
            if x is not static:
                static.copy_(x)
        if self.generator is None:
            self.graph.replay()
            return self.outputs
        caller = generator if generator is not None else _default_generator(self.generator)
        self.generator.set_state(caller.get_state())
        self.graph.replay()
        caller.set_state(self.generator.get_state())
        return self.outputs


def _default_generator(private: torch.Generator) -> torch.Generator:
    index = private.device.index if private.device.index is not None else torch.cuda.current_device()
    return torch.cuda.default_generators[index]

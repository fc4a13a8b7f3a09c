"""CosyVoice 3's vocoder noise, replayed from upstream's model-construction draws.

Upstream builds CausalHiFTGenerator with `torch.rand` tensors it never saves: initial phases
(1, 9), sine noise (1, 300*24000, 9) and uv noise (1, 300*24000, 1). Their values depend on
everything the CPU generator produced before them while the yaml was built, after
CausalConditionalCFM reseeded 0: the flow's noise randn(1, 80, 15000), the default init of the
flow's input_embedding and spk_embed_affine_layer, then the F0 predictor's. Those draws are
counted here (uniform float32: one mt19937 output per element; normal float32, vectorised:
numel, plus 16 when numel % 16); a private generator is advanced to each tensor's offset and
only the prefix a request needs is generated, so the 259 MB tensor never exists.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any

import torch

from mizuoto.nn.vocoders.f0 import CausalConvRNNF0Predictor
from mizuoto.errors import InvalidRequest, ModelLoadError

# Literals in upstream's constructors (not yaml sizes): CausalConditionalCFM's noise buffer,
# and SineGen2 / SourceModuleHnNSF's causal noise (300 s at 24 kHz, 9 harmonics).
FLOW_NOISE_SHAPE = (1, 80, 50 * 300)
NOISE_FRAMES = 300 * 24000
NOISE_DIM = 9
_SEED = 0


def _normal_draws(numel: int) -> int:
    """mt19937 outputs a float32 normal_ of `numel` elements consumes on the CPU."""
    if numel < 16:
        # Below 16 elements torch switches to its scalar path, which draws differently.
        raise ModelLoadError(f"cannot replay a normal init of {numel} elements (below 16)")
    # Vectorised Box-Muller in blocks of 16; a ragged tail redraws the last 16.
    return numel + (16 if numel % 16 else 0)


def advance_generator(generator: torch.Generator, n: int, chunk: int = 1 << 20) -> None:
    """Advance a CPU generator by n mt19937 outputs (float32 uniforms, one output each)."""
    # mt19937 has no cheap skip in torch or numpy (numpy's only jumps by 2**128), and stepping
    # the recurrence costs what drawing does; drawing in chunks keeps memory to one chunk.
    buffer = torch.empty(min(n, chunk))
    while n > 0:
        step = min(n, chunk)
        buffer[:step].uniform_(generator=generator)
        n -= step


@dataclass(frozen=True)
class NoisePlan:
    """mt19937 offsets (outputs after seeding 0) of each construction-time tensor."""

    rand_ini: int
    sine_waves: int
    uv: int


def _kwarg(node: Any, key: str, where: str) -> Any:
    try:
        return node[key]
    except (KeyError, TypeError):
        raise ModelLoadError(f"yaml `{where}` lacks `{key}`, needed to replay CosyVoice 3's vocoder noise") from None


def construction_plan(config: dict) -> NoisePlan:
    """Offsets of rand_ini, sine_waves and uv for the model a parsed cosyvoice3.yaml builds."""
    flow, hift = config.get("flow"), config.get("hift")
    f0 = _kwarg(hift, "f0_predictor", "hift")
    if int(_kwarg(hift, "nb_harmonics", "hift")) + 1 != NOISE_DIM:
        raise ModelLoadError(f"CosyVoice 3's causal source needs nb_harmonics {NOISE_DIM - 1}")
    offset = _normal_draws(math.prod(FLOW_NOISE_SHAPE))
    # CausalMaskedDiffWithDiT.__init__: Embedding (normal) then Linear (uniform weight, bias).
    offset += _normal_draws(int(_kwarg(flow, "vocab_size", "flow")) * int(_kwarg(flow, "input_size", "flow")))
    spk, out = int(_kwarg(flow, "spk_embed_dim", "flow")), int(_kwarg(flow, "output_size", "flow"))
    offset += spk * out + out
    # The F0 predictor (built before HiFT as its argument): every conv / linear draws its
    # weight then its bias, uniformly, in construction order; weight norm draws nothing.
    with torch.device("meta"):
        predictor = CausalConvRNNF0Predictor(int(_kwarg(f0, "num_class", "hift.f0_predictor")),
                                             int(_kwarg(f0, "in_channels", "hift.f0_predictor")),
                                             int(_kwarg(f0, "cond_channels", "hift.f0_predictor")))
    offset += sum(p.numel() for p in predictor.parameters())
    rand_ini = offset
    sine_waves = rand_ini + NOISE_DIM
    # m_source.l_linear = Linear(9, 1) is built between the sine and uv noise.
    uv = sine_waves + NOISE_FRAMES * NOISE_DIM + NOISE_DIM + 1
    return NoisePlan(rand_ini, sine_waves, uv)


class _Prefix:
    """A growing prefix of one uniform tensor (1, NOISE_FRAMES, dim) starting at an offset."""

    def __init__(self, offset: int, dim: int):
        self.offset, self.dim = offset, dim
        self.values = torch.empty(1, 0, dim)
        self.generator: torch.Generator | None = None

    def get(self, length: int) -> torch.Tensor:
        if length > NOISE_FRAMES:
            raise InvalidRequest(f"CosyVoice 3's vocoder noise covers {NOISE_FRAMES} samples (300 s); "
                                 f"this audio needs {length}")
        have = self.values.shape[1]
        if length > have:
            if self.generator is None:
                self.generator = torch.Generator().manual_seed(_SEED)
                advance_generator(self.generator, self.offset)
            # Grow geometrically so streaming re-runs do not redraw-and-copy at every chunk.
            target = min(NOISE_FRAMES, max(length, 2 * have))
            more = torch.rand(1, target - have, self.dim, generator=self.generator)
            self.values = torch.cat([self.values, more], dim=1)
        return self.values[:, :length]


class CosyVoice3Noise:
    """Upstream CausalHiFT's construction-time noise, generated lazily (a FixedSourceNoise)."""

    def __init__(self, plan: NoisePlan):
        self.plan = plan
        self._lock = threading.Lock()
        self._rand_ini: torch.Tensor | None = None
        self._sine = _Prefix(plan.sine_waves, NOISE_DIM)
        self._uv = _Prefix(plan.uv, 1)

    def rand_ini(self) -> torch.Tensor:
        """Initial phases (1, 9); the fundamental's is 0."""
        with self._lock:
            if self._rand_ini is None:
                g = torch.Generator().manual_seed(_SEED)
                advance_generator(g, self.plan.rand_ini)
                rand_ini = torch.rand(1, NOISE_DIM, generator=g)
                rand_ini[:, 0] = 0
                self._rand_ini = rand_ini
            return self._rand_ini

    def sine_waves(self, length: int) -> torch.Tensor:
        """sine_waves[:, :length] of upstream's (1, 7.2M, 9) buffer."""
        with self._lock:
            return self._sine.get(length)

    def uv(self, length: int) -> torch.Tensor:
        """uv[:, :length] of upstream's (1, 7.2M, 1) buffer (its noise branch: HiFT's output never uses it)."""
        with self._lock:
            return self._uv.get(length)


def cosyvoice3_noise(config: dict) -> CosyVoice3Noise:
    """The vocoder noise upstream draws while building the model a parsed cosyvoice3.yaml describes."""
    return CosyVoice3Noise(construction_plan(config))

"""Token samplers that wait on the device once per token and draw what upstream's loop draws.

Upstream CosyVoice's `nucleus_sampling` grows the nucleus in Python: every kept token reads
the running sum back to the host, the kept probabilities go to the host and back, and
`multinomial` checks its input on the host. Here the same arithmetic runs as device ops:

- The nucleus loop is replayed over the sorted top `top_k`: the running sums are the same
  0-d additions in the score dtype, one after the other (a `cumsum` would round differently),
  and each is compared with `top_p` by the same comparison op; the kept prefix is the leading
  run of passed tests, as the loop stops at the first failure.
- The draw is `multinomial(1, replacement=True)`'s own algorithm (torch's single-sample path:
  `argmax(p / q)` with `q = empty_like(p).exponential_(1)`), on a `top_k`-long buffer whose
  entries past the nucleus are masked out. Element i of an exponential draw does not depend on
  how many are drawn, so the first n exponentials of a `top_k` draw are those of an n-element
  draw; on CUDA the Philox offset also advances by the same amount for any length up to a
  thousand elements, so tokens *and* generator state equal upstream's for every n.
- The CPU generator (mt19937) consumes one draw per element, so there the state after a
  `top_k` draw would differ: off CUDA the sampler reads n (free on the CPU: no device to wait
  for) and draws exactly n exponentials. `fixed_draws` chooses explicitly.

Only the final token crosses to the host. A repetition (`ras_sampling`'s window) is rare and
handled eagerly, exactly as upstream does it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Sequence

import torch


def nucleus_keep(values: torch.Tensor, top_p: float) -> torch.Tensor:
    """Upstream's loop condition replayed: a bool mask of the kept prefix of sorted probabilities.

    `values` are the first top_k sorted probabilities (the loop's top_k cap is their length).
    """
    if not 0.0 < top_p:
        # upstream would keep nothing and multinomial would fail on an empty tensor
        raise ValueError(f"top_p must be > 0, got {top_p}")
    k = values.shape[0]
    # The loop's first sum, `0.0 + sorted_value[0]`, is sorted_value[0] exactly (values >= 0).
    sums = [values[0]]
    for i in range(1, k - 1):
        sums.append(sums[-1] + values[i])
    keep = torch.ones(k, dtype=torch.bool, device=values.device)  # step 0: 0.0 < top_p
    if k > 1:
        # step i >= 1 tests the sum of the first i values; the loop stops at the first failure
        keep[1:] = (torch.stack(sums) < top_p).cumprod(0).bool()
    return keep


def nucleus_draw(scores: torch.Tensor, generator: torch.Generator | None = None, top_p: float = 0.8,
                 top_k: int = 25, fixed_draws: bool | None = None) -> torch.Tensor:
    """Upstream's `nucleus_sampling` on the device: the token id as a 0-d int64 tensor.

    `fixed_draws`: draw top_k exponentials whatever the nucleus size (no host read; equal
    generator state only where the generator's consumption does not depend on the length, i.e.
    CUDA's Philox); False reads n and draws exactly n. Default: True on CUDA only.
    """
    if fixed_draws is None:
        fixed_draws = scores.device.type == "cuda"
    values, ids = scores.softmax(dim=0).sort(descending=True, stable=True)
    k = min(int(top_k), values.shape[0])
    if k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    values, ids = values[:k], ids[:k]
    keep = nucleus_keep(values, top_p)
    q = torch.ones_like(values)
    drawn = k if fixed_draws else int(keep.sum())
    q[:drawn].exponential_(1, generator=generator)
    # multinomial divides the probabilities by the exponentials in the probabilities' dtype
    ratio = torch.where(keep, values / q, torch.full_like(values, -float("inf")))
    # index_select, not ids[tensor]: indexing with a 0-d tensor may read it on the host
    return ids.index_select(0, ratio.argmax().reshape(1)).reshape(())


def random_draw(scores: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """Upstream's `random_sampling`: one draw from the full softmax (already one host read)."""
    return int(scores.softmax(dim=0).multinomial(1, replacement=True, generator=generator).item())


def ras_draw(scores: torch.Tensor, decoded: Sequence[int], generator: torch.Generator | None = None,
             top_p: float = 0.8, top_k: int = 25, win_size: int = 10, tau_r: float = 0.1,
             fixed_draws: bool | None = None) -> int:
    """Upstream's `ras_sampling` with the nucleus draw on the device: one host read per token.

    A repetition in the last `win_size` tokens sets the drawn id's score to -inf in `scores`
    itself and redraws from the full distribution, eagerly, as upstream does.
    """
    sampler = FastSampler("ras_sampling", top_p, top_k, win_size, tau_r, fixed_draws)
    return sampler(scores, decoded, generator)


SAMPLER_KINDS = ("ras_sampling", "nucleus_sampling", "random_sampling")


@dataclass(frozen=True)
class SamplerSettings:
    """Which of upstream CosyVoice's samplers, with its keyword arguments (defaults: upstream's)."""

    kind: str = "ras_sampling"
    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1


@dataclass(frozen=True)
class FastSampler(SamplerSettings):
    """Drop-in for a CosyVoice `Sampler` (same fields, same call) using the on-device draw."""

    fixed_draws: bool | None = None

    @classmethod
    def like(cls, sampler: Any, fixed_draws: bool | None = None) -> "FastSampler":
        """The fast version of any object with upstream's sampler fields (kind, top_p, ...); missing ones default."""
        kind = getattr(sampler, "kind", SamplerSettings.kind)
        if kind not in SAMPLER_KINDS:
            raise ValueError(f"no fast path for sampler kind {kind!r}")
        numbers = {f.name: type(f.default)(getattr(sampler, f.name, f.default))
                   for f in fields(SamplerSettings) if f.name != "kind"}
        return cls(kind=kind, fixed_draws=fixed_draws, **numbers)

    def draw(self, scores: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """The first (nucleus) draw as a device tensor, with no host read (kinds with a nucleus)."""
        return nucleus_draw(scores, generator, self.top_p, self.top_k, self.fixed_draws)

    def finish(self, token: int, scores: torch.Tensor, decoded: Sequence[int],
               generator: torch.Generator | None) -> int:
        """After `draw`'s token reached the host: ras's eager redraw when it repeats."""
        if self.kind != "ras_sampling":
            return token
        # upstream's window slice, quirks included (win_size 0 takes the whole history)
        if list(decoded[-self.win_size:]).count(token) >= self.win_size * self.tau_r:
            scores[token] = -float("inf")
            token = random_draw(scores, generator)
        return token

    def __call__(self, scores: torch.Tensor, decoded: Sequence[int],
                 generator: torch.Generator | None) -> int:
        """Draw one token id from 1-D log-probabilities (may modify `scores`, as upstream)."""
        if self.kind == "random_sampling":
            return random_draw(scores, generator)
        return self.finish(int(self.draw(scores, generator).item()), scores, decoded, generator)


def on_device(sampler: Any) -> Any:
    """The fast on-device form (`FastSampler`) of an upstream-style sampler, one whose `kind` is known here; any
    other sampler (an engine's own draw, or None) as it is: its distribution is never swapped for another."""
    return FastSampler.like(sampler) if getattr(sampler, "kind", None) in SAMPLER_KINDS else sampler

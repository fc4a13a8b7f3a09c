"""Conditional flow matching sampler: Euler steps on a cosine schedule with classifier-free guidance.

The estimator is pluggable (U-Net for CosyVoice 1/2 and Chatterbox, DiT for CosyVoice 3): any module
called as estimator(x, mask, mu, t, spks, cond, streaming=...) returning the velocity. `meanflow`
is Chatterbox Turbo's sampler: a linear schedule, no guidance, the estimator told each step's end
time r as well. (Chatterbox's Euler loop reads t and dt off the schedule where this one accumulates
them; on the float32 cosine schedules of 2 to 30 steps both give the same bits: t + (s - t) == s.)
"""

from __future__ import annotations

import threading

import torch
from torch import nn

# Upstream draws its fixed flow noise once, as randn(1, 80, 50 * 300) right after seeding 0.
FIXED_NOISE_SEED = 0
FIXED_NOISE_SHAPE = (1, 80, 50 * 300)

_noise_lock = threading.Lock()
_noise_cache: dict[tuple[int, ...], torch.Tensor] = {}


def fixed_noise(shape: tuple[int, ...] = FIXED_NOISE_SHAPE) -> torch.Tensor:
    """The first normal draws of a CPU generator seeded 0, in `shape`; generated once per process."""
    shape = tuple(shape)
    with _noise_lock:
        noise = _noise_cache.get(shape)
        if noise is None:
            generator = torch.Generator(device="cpu").manual_seed(FIXED_NOISE_SEED)
            noise = torch.randn(shape, generator=generator)
            _noise_cache[shape] = noise
    return noise


class ConditionalCFM(nn.Module):
    """Flow-matching decoder around an `estimator`; noise fixed (v2/v3) or drawn per call (v1).

    v1 also keeps upstream's streaming cache: the prompt's and the last `overlap_frames` frames'
    noise and mu, reused by the next chunk so overlapping chunks agree (`forward_cached`).
    """

    def __init__(self, estimator: nn.Module, inference_cfg_rate: float = 0.7, t_scheduler: str = "cosine",
                 fixed: bool = False, overlap_frames: int | None = None, meanflow: bool = False):
        super().__init__()
        if t_scheduler not in ("cosine", "linear"):
            raise ValueError(f"t_scheduler {t_scheduler!r} is not supported (cosine or linear)")
        self.estimator = estimator
        self.inference_cfg_rate = inference_cfg_rate
        self.t_scheduler = t_scheduler
        self.fixed = fixed
        self.overlap_frames = overlap_frames
        self.meanflow = meanflow

    def t_span(self, n_timesteps: int, like: torch.Tensor) -> torch.Tensor:
        """n_timesteps + 1 times from 0 to 1."""
        t_span = torch.linspace(0, 1, n_timesteps + 1, device=like.device, dtype=like.dtype)
        if self.t_scheduler == "cosine" and not self.meanflow:
            t_span = 1 - torch.cos(t_span * 0.5 * torch.pi)
        return t_span

    def initial_noise(self, mu: torch.Tensor, temperature: float = 1.0,
                      generator: torch.Generator | None = None) -> torch.Tensor:
        """x at t=0: the fixed buffer's first T frames, or fresh draws shaped like mu."""
        if self.fixed:
            noise = fixed_noise((FIXED_NOISE_SHAPE[0], mu.size(1), FIXED_NOISE_SHAPE[2]))
            if mu.size(2) > noise.size(2):
                raise ValueError(f"the flow handles at most {noise.size(2)} frames at once, got {mu.size(2)}")
            z = noise[:, :, :mu.size(2)]
        else:
            device = generator.device if generator is not None else mu.device
            z = torch.randn(mu.shape, generator=generator, device=device, dtype=torch.float32)
        return z.to(mu.device).to(mu.dtype) * temperature

    @torch.inference_mode()
    def forward(self, mu: torch.Tensor, mask: torch.Tensor, n_timesteps: int, temperature: float = 1.0,
                spks: torch.Tensor | None = None, cond: torch.Tensor | None = None,
                streaming: bool = False, generator: torch.Generator | None = None,
                noise_tail: torch.Tensor | None = None) -> torch.Tensor:
        """Mel (B, n_feats, T) from encoder output mu (B, n_feats, T).

        noise_tail (B, n_feats, T'): replaces the last T' frames of the noise (drawn all the same first).
        """
        z = self.initial_noise(mu, temperature, generator)
        if noise_tail is not None:
            z[..., z.size(2) - noise_tail.size(2):] = noise_tail
        if self.meanflow:
            return self.solve_mean_flow(z, self.t_span(n_timesteps, mu), mu, mask, spks, cond, streaming)
        return self.solve_euler(z, self.t_span(n_timesteps, mu), mu, mask, spks, cond, streaming)

    @torch.inference_mode()
    def forward_cached(self, mu: torch.Tensor, mask: torch.Tensor, n_timesteps: int,
                       spks: torch.Tensor, cond: torch.Tensor, prompt_len: int, cache: torch.Tensor,
                       temperature: float = 1.0, generator: torch.Generator | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """v1 streaming: as forward, with the first frames' noise and mu taken from `cache`.

        cache is (1, n_feats, frames, 2) [noise, mu]; the returned cache holds the prompt's and
        the last overlap frames' values for the next chunk. mu is updated in place, as upstream.
        """
        if not self.overlap_frames:
            raise ValueError("forward_cached needs overlap_frames (the mel frames of a chunk overlap)")
        z = self.initial_noise(mu, temperature, generator)
        cache_size = cache.shape[2]
        if cache_size != 0:
            z[:, :, :cache_size] = cache[:, :, :, 0]
            mu[:, :, :cache_size] = cache[:, :, :, 1]
        z_cache = torch.concat([z[:, :, :prompt_len], z[:, :, -self.overlap_frames:]], dim=2)
        mu_cache = torch.concat([mu[:, :, :prompt_len], mu[:, :, -self.overlap_frames:]], dim=2)
        new_cache = torch.stack([z_cache, mu_cache], dim=-1)
        mel = self.solve_euler(z, self.t_span(n_timesteps, mu), mu, mask, spks, cond, False)
        return mel, new_cache

    def solve_euler(self, x: torch.Tensor, t_span: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor,
                    spks: torch.Tensor, cond: torch.Tensor, streaming: bool = False) -> torch.Tensor:
        """Fixed-step Euler with CFG, conditional and unconditional rows in one batch of 2."""
        t, dt = t_span[0], t_span[1] - t_span[0]
        t = t.unsqueeze(dim=0)
        n_feats, frames = x.size(1), x.size(2)
        # One batch of two rows (conditional, then all-zero conditions) per step; the
        # estimator's numerics depend on that batching, so it is kept.
        dtype = spks.dtype
        x_in = torch.zeros([2, n_feats, frames], device=x.device, dtype=dtype)
        mask_in = torch.zeros([2, 1, frames], device=x.device, dtype=dtype)
        mu_in = torch.zeros([2, mu.size(1), frames], device=x.device, dtype=dtype)
        t_in = torch.zeros([2], device=x.device, dtype=dtype)
        spks_in = torch.zeros([2, spks.size(-1)], device=x.device, dtype=dtype)
        cond_in = torch.zeros([2, cond.size(1), frames], device=x.device, dtype=dtype)
        for step in range(1, len(t_span)):
            x_in[:] = x
            mask_in[:] = mask
            mu_in[0] = mu
            t_in[:] = t
            spks_in[0] = spks
            cond_in[0] = cond
            velocity = self.estimator(x_in, mask_in, mu_in, t_in, spks_in, cond_in, streaming=streaming)
            velocity, cfg_velocity = torch.split(velocity, [x.size(0), x.size(0)], dim=0)
            velocity = (1.0 + self.inference_cfg_rate) * velocity - self.inference_cfg_rate * cfg_velocity
            x = x + dt * velocity
            t = t + dt
            if step < len(t_span) - 1:
                dt = t_span[step + 1] - t
        return x.float()

    def solve_mean_flow(self, x: torch.Tensor, t_span: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor,
                        spks: torch.Tensor, cond: torch.Tensor, streaming: bool = False) -> torch.Tensor:
        """Mean-flow Euler: one estimator call per step from t to r, unguided, batch as given."""
        for t, r in zip(t_span[:-1], t_span[1:]):
            t, r = t[None], r[None]
            velocity = self.estimator(x, mask, mu, t, spks, cond, streaming=streaming, r=r)
            x = x + (r - t) * velocity
        return x.float()

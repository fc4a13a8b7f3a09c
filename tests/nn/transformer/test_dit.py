"""The DiT flow estimator on its own: shapes, what each output frame may see, and the rotary quirk.

Sizes are passed in (random init, seeded); the parity of the whole CosyVoice 3 flow with upstream
is checked end to end in tests/engines/cosyvoice/test_cases.py. Here: padded frames and (when
streaming) later chunks cannot reach an output frame, while without streaming every valid frame
sees every other; the rotary table turns only the first `dim_head` channels (x_transformers'
behaviour that upstream inherits); the timestep may be a scalar or one per batch row.
"""

from __future__ import annotations

import pytest
import torch

from mizuoto.nn.transformer.dit import DiT, RotaryEmbedding, apply_rotary

MEL, MU, SPK, DIM, HEADS, DIM_HEAD = 8, 6, 4, 32, 2, 16
# outputs that must not depend on a change: the attention weight of a masked key is exactly 0, but
# the kernels may add the remaining terms in another order, so allow a few float32 ulps
ATOL = 1e-6


def _dit(chunk: int = 4, **kw) -> DiT:
    torch.manual_seed(0)
    return DiT(dim=DIM, depth=2, heads=HEADS, dim_head=DIM_HEAD, ff_mult=2, mel_dim=MEL, mu_dim=MU,
               spk_dim=SPK, static_chunk_size=chunk, **kw).eval()


def _inputs(batch: int = 1, frames: int = 12, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, MEL, frames, generator=g)
    mu = torch.randn(batch, MU, frames, generator=g)
    cond = torch.randn(batch, MEL, frames, generator=g)
    spks = torch.randn(batch, SPK, generator=g)
    mask = torch.ones(batch, 1, frames)
    return {"x": x, "mask": mask, "mu": mu, "t": torch.tensor(0.3), "spks": spks, "cond": cond}


def _run(model: DiT, inputs: dict, streaming: bool = False) -> torch.Tensor:
    with torch.inference_mode():
        return model(**inputs, streaming=streaming)


def _changed_at(inputs: dict, frames: slice) -> dict:
    out = {k: v.clone() for k, v in inputs.items()}
    for name in ("x", "mu", "cond"):
        out[name][:, :, frames] += 5.0
    return out


def test_output_shape_and_dtype():
    out = _run(_dit(), _inputs(batch=2, frames=10))
    assert out.shape == (2, MEL, 10) and out.dtype == torch.float32 and torch.isfinite(out).all()


def test_padded_frames_reach_no_valid_frame():
    model, inputs = _dit(), _inputs(frames=12)
    inputs["mask"][:, :, 9:] = 0
    base = _run(model, inputs)
    moved = _run(model, _changed_at(inputs, slice(9, 12)))
    assert torch.allclose(moved[:, :, :9], base[:, :, :9], atol=ATOL, rtol=0)


def test_without_streaming_every_frame_sees_every_other():
    model, inputs = _dit(), _inputs(frames=12)
    base = _run(model, inputs)
    moved = _run(model, _changed_at(inputs, slice(11, 12)))
    assert (moved[:, :, 0] - base[:, :, 0]).abs().max() > 1e-3, "the first frame did not see the last"


@pytest.mark.parametrize("chunk", [3, 4])
def test_streaming_frames_see_up_to_the_end_of_their_chunk(chunk):
    model, inputs = _dit(chunk=chunk), _inputs(frames=12)
    base = _run(model, inputs, streaming=True)
    start = 2 * chunk  # change the first frame of the third chunk
    moved = _run(model, _changed_at(inputs, slice(start, start + 1)), streaming=True)
    assert torch.allclose(moved[:, :, :start], base[:, :, :start], atol=ATOL, rtol=0), "a later chunk leaked"
    # the causal position conv carries a frame to the frames after it, attention to its whole chunk
    assert (moved[:, :, start:start + chunk] - base[:, :, start:start + chunk]).abs().amax(dim=1).min() > 1e-4


def test_scalar_timestep_equals_one_per_row():
    model, inputs = _dit(), _inputs(batch=2)
    per_row = dict(inputs, t=inputs["t"].repeat(2))
    assert torch.equal(_run(model, inputs), _run(model, per_row))


def test_rows_of_a_batch_are_independent():
    model, inputs = _dit(), _inputs(batch=2)
    both = _run(model, inputs)
    second = _run(model, {k: (v[1:] if v.dim() else v) for k, v in inputs.items()})
    assert torch.allclose(both[1:], second, atol=ATOL, rtol=0)


def test_rotary_turns_only_the_first_dim_head_channels():
    freqs = RotaryEmbedding(DIM_HEAD)(5)
    assert freqs.shape == (1, 5, DIM_HEAD)
    t = torch.randn(1, 5, HEADS * DIM_HEAD, generator=torch.Generator().manual_seed(2))
    out = apply_rotary(t, freqs)
    assert torch.equal(out[..., DIM_HEAD:], t[..., DIM_HEAD:])
    assert torch.equal(out[:, 0], t[:, 0]), "position 0 is not rotated"
    # interleaved pairs are rotated: each pair keeps its length
    pairs_in, pairs_out = t[..., :DIM_HEAD].unflatten(-1, (-1, 2)), out[..., :DIM_HEAD].unflatten(-1, (-1, 2))
    assert torch.allclose(pairs_in.norm(dim=-1), pairs_out.norm(dim=-1), atol=1e-6)
    assert not torch.allclose(out[:, 1:, :DIM_HEAD], t[:, 1:, :DIM_HEAD])


def test_optional_parts_follow_the_arguments():
    assert _dit().long_skip_connection is None
    skip = _dit(long_skip_connection=True)
    assert skip.long_skip_connection.weight.shape == (DIM, 2 * DIM)
    assert _run(skip, _inputs()).shape == (1, MEL, 12)
    no_spk = DiT(dim=DIM, depth=1, heads=HEADS, dim_head=DIM_HEAD, ff_mult=2, mel_dim=MEL, mu_dim=None,
                 spk_dim=None, static_chunk_size=4)
    assert no_spk.input_embed.proj.in_features == 3 * MEL
    inputs = _inputs()
    inputs["mu"] = torch.randn(1, MEL, 12)
    assert _run(no_spk.eval(), inputs).shape == (1, MEL, 12)

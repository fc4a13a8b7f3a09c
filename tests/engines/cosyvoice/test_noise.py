"""CosyVoice 3's construction-time vocoder noise, replayed: prefixes and full-tensor sha256.

Discovered from the fixture tree: every `cosyvoice/*/cases/construction_noise.json` (with the
model dir's yaml) and every `cosyvoice/*/fullsize_construction_noise.json` (with each full-size
cosyvoice3.yaml in the shared assets). The full tensors are hashed chunk by chunk, never held.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mizuoto.engines.cosyvoice.noise import (FLOW_NOISE_SHAPE, NOISE_DIM, NOISE_FRAMES, advance_generator,
                                             construction_plan, cosyvoice3_noise)
from mizuoto.errors import InvalidRequest, ModelLoadError
from mizuoto.runtime.hyperyaml import load_hyperyaml
from mizuoto.testing.fixtures import assets_root, fixtures_root

_PREFIX = re.compile(r"^(?P<name>[\w.]+?)(?:\[(?P<index>[^\]]*)\])?$")


def _sets() -> list[tuple[str, Path, Path]]:
    """(id, noise json, yaml) for every recorded construction-noise set."""
    base = fixtures_root() / "cosyvoice"
    found = []
    for path in sorted(base.glob("*/cases/construction_noise.json")):
        yamls = sorted((path.parent.parent / "model").glob("cosyvoice*.yaml"))
        assert len(yamls) == 1, f"{path}: expected one yaml in the model dir"
        found.append((f"{path.parent.parent.name}-tiny", path, yamls[0]))
    full_yamls = sorted((assets_root() / "cosyvoice").glob("*/cosyvoice3.yaml"))
    for path in sorted(base.glob("*/fullsize_construction_noise.json")):
        assert full_yamls, "no full-size cosyvoice3.yaml under the shared assets"
        found += [(f"{path.parent.name}-full-{y.parent.name}", path, y) for y in full_yamls]
    assert found, "no construction-noise fixtures found"
    return found


SETS = _sets()


def _tensors(json_path: Path) -> dict[str, tuple[str, torch.Tensor]]:
    """Stored tensors by base name: (index expression, tensor)."""
    out = {}
    for key, value in load_file(str(json_path.with_suffix(".safetensors"))).items():
        m = _PREFIX.match(key)
        assert m, key
        out[m["name"]] = (m["index"] or "", value)
    return out


def _sha256(json_path: Path) -> dict[str, str]:
    meta = json.loads(json_path.read_text())
    return meta.get("sha256_full") or meta["sha256_full_f32"]


def _prefix_len(index: str, axis: int) -> int:
    """`:, :48000` -> 48000 (the slice on `axis`)."""
    parts = [p.strip() for p in index.split(",")]
    m = re.fullmatch(r":(\d+)", parts[axis])
    assert m, f"unexpected index {index!r}"
    return int(m.group(1))


def _stream_sha(offset: int, dim: int, frames: int, chunk: int = 1 << 18) -> str:
    g = torch.Generator().manual_seed(0)
    advance_generator(g, offset)
    h = hashlib.sha256()
    done = 0
    while done < frames:
        n = min(chunk, frames - done)
        h.update(torch.rand(n, dim, generator=g).numpy().tobytes())
        done += n
    return h.hexdigest()


@pytest.mark.parametrize("set_id,json_path,yaml_path", SETS, ids=[s[0] for s in SETS])
def test_flow_noise_is_seed0_normal(set_id, json_path, yaml_path):
    """The recipe's first step (the flow's buffer), whose draws the offsets count."""
    index, stored = _tensors(json_path)["flow.decoder.rand_noise"]
    noise = torch.randn(FLOW_NOISE_SHAPE, generator=torch.Generator().manual_seed(0))
    assert torch.equal(noise[:, :, :_prefix_len(index, 2)], stored)
    assert hashlib.sha256(noise.numpy().tobytes()).hexdigest() == _sha256(json_path)["flow.decoder.rand_noise"]


def _hift_sets():
    return [s for s in SETS if "hift.m_source.l_sin_gen.rand_ini" in _tensors(s[1])]


HIFT_SETS = _hift_sets()


@pytest.mark.parametrize("set_id,json_path,yaml_path", HIFT_SETS, ids=[s[0] for s in HIFT_SETS])
def test_replayed_prefixes_equal_upstreams(set_id, json_path, yaml_path):
    stored = _tensors(json_path)
    noise = cosyvoice3_noise(load_hyperyaml(yaml_path))
    assert torch.equal(noise.rand_ini(), stored["hift.m_source.l_sin_gen.rand_ini"][1])
    index, sine = stored["hift.m_source.l_sin_gen.sine_waves"]
    n = _prefix_len(index, 1)
    assert torch.equal(noise.sine_waves(n), sine)
    # Growing the prefix keeps what was handed out before (streaming re-runs ask for more).
    assert torch.equal(noise.sine_waves(n // 3), sine[:, :n // 3])
    assert torch.equal(noise.sine_waves(n + 1000)[:, :n], sine)
    index, uv = stored["hift.m_source.uv"]
    assert torch.equal(noise.uv(_prefix_len(index, 1)), uv)


@pytest.mark.parametrize("set_id,json_path,yaml_path", HIFT_SETS, ids=[s[0] for s in HIFT_SETS])
def test_full_tensors_hash_to_upstreams(set_id, json_path, yaml_path):
    plan = construction_plan(load_hyperyaml(yaml_path))
    sha = _sha256(json_path)
    assert _stream_sha(plan.sine_waves, NOISE_DIM, NOISE_FRAMES) == sha["hift.m_source.l_sin_gen.sine_waves"]
    assert _stream_sha(plan.uv, 1, NOISE_FRAMES) == sha["hift.m_source.uv"]


def test_advance_equals_drawing():
    for n in (0, 1, 623, 624, 625, 5000, (1 << 20) + 3):
        a = torch.Generator().manual_seed(0)
        advance_generator(a, n)
        b = torch.Generator().manual_seed(0)
        torch.rand(n, generator=b)
        assert torch.equal(torch.rand(8, generator=a), torch.rand(8, generator=b)), n


def test_longer_than_upstreams_buffer_is_refused():
    noise = cosyvoice3_noise(load_hyperyaml(HIFT_SETS[0][2]))
    with pytest.raises(InvalidRequest, match="300 s"):
        noise.sine_waves(NOISE_FRAMES + 1)


def test_yaml_without_sizes_is_refused():
    config = load_hyperyaml(HIFT_SETS[0][2])
    del config["flow"].kwargs["vocab_size"]
    with pytest.raises(ModelLoadError, match="vocab_size"):
        construction_plan(config)

"""HiFT against upstream: every recorded hift call whose randomness is reproducible standalone.

Reproducible standalone: CosyVoice 3 (noise fixed at construction, no run-time draws) and
every CosyVoice 1/2 case without LM draws (voice conversion): the request generator is seeded
with the case seed; a CosyVoice 1 flow first draws randn_like(mu) of (1, 80, prompt + target
mel), replayed here by drawing that shape; HiFT then draws in call order. Streaming calls chain
the previous call's source tail as the cache, as the scheduler does. Cases with LM draws are
covered end to end by the engine tests.

The fixtures were recorded where MKL ran its Intel code paths; on other CPUs (AMD) MKL picks
other kernels whose results differ in the last bit (measured without them: speech max 2e-7,
source max 3e-8; upstream's own code run there gives exactly what this implementation gives).
The suite's `mizuoto.testing.mkl_intel` plugin puts MKL on its Intel paths, so the check is
`torch.equal`, sample for sample; where it could not, the parity tests fail saying so. The cases
were recorded on one CPU class (mizuoto.testing.cpu_recordings): on a class they were not recorded
on, speech is compared within the spread upstream's own HiFT speech shows between the recorded
classes (kind `seg.<i>.hift.<i>.speech`); the source (and its cached tail), HiFT's excitation
waveform at the same rate, which the full-pipeline recordings do not record, takes the same kind.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mizuoto.engines.cosyvoice.hift import build_hift, convert_state_dict, load_hift
from mizuoto.engines.cosyvoice.noise import cosyvoice3_noise
from mizuoto.nn.vocoders.hift import CausalHiFTGenerator
from mizuoto.nn.vocoders.layers import fold_weight_norm
from mizuoto.errors import ModelLoadError
from mizuoto.runtime.hyperyaml import load_hyperyaml
from mizuoto.testing.cosyvoice_cases import list_cases, load_case
from mizuoto.testing.cpu_recordings import SPEECH, tree_comparison
from mizuoto.testing.mkl_intel import require_intel_path


def _config(ref) -> dict:
    return load_hyperyaml(ref.yaml_path)


def _standalone(ref) -> bool:
    """Whether the generator state at each hift call can be rebuilt without running the LM."""
    meta = json.loads(ref.json_path.read_text())
    if not meta.get("hift_calls"):
        return False
    return _config(ref)["hift"].cls == "CausalHiFTGenerator" or meta.get("lm_tokens_raw_len", 1) == 0


CASES = [ref for ref in list_cases() if _standalone(ref)]
assert CASES, "no HiFT case reproducible standalone in the fixtures"


def _run_cases(refs) -> dict[str, list[dict]]:
    """Run every hift call of the cases; per call: (ours, upstream's) speech, source and cache."""
    models: dict[Path, torch.nn.Module] = {}
    results = {}
    for ref in refs:
        case = load_case(ref)
        config = _config(ref)
        if ref.model_dir not in models:
            noise = cosyvoice3_noise(config) if config["hift"].cls == "CausalHiFTGenerator" else None
            models[ref.model_dir] = load_hift(ref.model_dir / "hift.pt", config, noise)
        model = models[ref.model_dir]
        flow_draws = config["flow"]["decoder"].cls == "ConditionalCFM"
        generator = torch.Generator().manual_seed(case.seed)
        prompt = case.input("prompt_speech_feat")
        prompt_frames = prompt.shape[1] if prompt is not None else 0
        out, previous = [], None
        for i, call in enumerate(case.meta["hift_calls"]):
            mel = case[f"hift.{i}.mel"]
            row = {}
            if isinstance(model, CausalHiFTGenerator):
                speech, source = model.inference(mel, finalize=call["finalize"])
            else:
                if flow_draws:
                    # CosyVoice 1's flow drew z = randn_like(mu), mu (1, 80, prompt + target frames).
                    frames = prompt_frames + case[f"flow.{i}.mel"].shape[2]
                    torch.randn(1, config["flow"]["output_size"], frames, generator=generator)
                expected_cache = case[f"hift.{i}.cache_source"]
                cache = previous[:, :, -expected_cache.shape[2]:] if expected_cache.shape[2] else expected_cache
                row["cache"] = (cache, expected_cache)
                speech, source = model.inference(mel, cache, generator=generator)
            previous = source
            for name, got in (("speech", speech), ("source", source)):
                row[name] = (got, case[f"hift.{i}.{name}"])
            out.append(row)
        results[ref.id] = out
    return results


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict]]:
    require_intel_path()
    return _run_cases(CASES)


@pytest.mark.parametrize("ref", CASES, ids=[r.id for r in CASES])
def test_hift_calls_equal_upstream(results, ref):
    calls = results[ref.id]
    assert calls, f"{ref.id}: no hift call ran"
    cpu = tree_comparison("cosyvoice")
    for i, row in enumerate(calls):
        if "cache" in row:
            cpu.assert_equal(*row["cache"], SPEECH, f"{ref.id} call {i}: cache_source against the previous source tail")
        cpu.assert_equal(*row["speech"], SPEECH, f"{ref.id} call {i} speech")
        cpu.assert_equal(*row["source"], SPEECH, f"{ref.id} call {i} source")


# --- loading ---------------------------------------------------------------------------------

MODEL_DIRS = sorted({ref.model_dir for ref in list_cases()})


def _load(model_dir: Path, path: Path | None = None):
    config = load_hyperyaml(next(model_dir.glob("cosyvoice*.yaml")))
    noise = cosyvoice3_noise(config) if config["hift"].cls == "CausalHiFTGenerator" else None
    return load_hift(path or model_dir / "hift.pt", config, noise), config, noise


def _upstream_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """hift.pt in torch >= 2.1 key style, whatever style the file uses (a tree may hold either).

    Upstream's loader strips a `generator.` prefix; legacy `weight_g` / `weight_v` are the
    parametrization's original0 / original1.
    """
    out = {}
    for key, value in state.items():
        key = key.removeprefix("generator.")
        key = key.replace(".weight_g", ".parametrizations.weight.original0")
        key = key.replace(".weight_v", ".parametrizations.weight.original1")
        out[key] = value
    return out


def _legacy_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same state in legacy style under a `generator.` prefix."""
    out = {}
    for key, value in _upstream_keys(state).items():
        key = key.replace(".parametrizations.weight.original0", ".weight_g")
        key = key.replace(".parametrizations.weight.original1", ".weight_v")
        out[f"generator.{key}"] = value
    return out


def _hift_state(model_dir: Path) -> dict[str, torch.Tensor]:
    return _upstream_keys(torch.load(model_dir / "hift.pt", weights_only=True))


@pytest.mark.parametrize("model_dir", MODEL_DIRS, ids=[d.parent.name for d in MODEL_DIRS])
def test_every_fixture_hift_loads_strictly(model_dir):
    model, config, _ = _load(model_dir)
    state = _hift_state(model_dir)
    normed = model.weight_normed()
    assert normed, "no weight-normed conv found"
    # Each weight-normed conv arrives as two tensors (g, v) and becomes one weight.
    assert len(model.state_dict()) == len(state) - len(normed)
    for name in normed:
        g = state[f"{name}.parametrizations.weight.original0"]
        v = state[f"{name}.parametrizations.weight.original1"]
        dtype = torch.float64 if name.startswith("f0_predictor.") and isinstance(model, CausalHiFTGenerator) \
            else torch.float32
        assert torch.equal(model.get_parameter(f"{name}.weight"), fold_weight_norm(g, v, dtype)), name


@pytest.mark.parametrize("style", [_upstream_keys, _legacy_keys], ids=["parametrizations", "legacy-generator"])
@pytest.mark.parametrize("model_dir", MODEL_DIRS, ids=[d.parent.name for d in MODEL_DIRS])
def test_both_weight_norm_key_styles_load_the_same(model_dir, style, tmp_path):
    model, config, noise = _load(model_dir)
    torch.save(style(torch.load(model_dir / "hift.pt", weights_only=True)), tmp_path / "hift.pt")
    again = load_hift(tmp_path / "hift.pt", config, noise)
    assert list(model.state_dict()) == list(again.state_dict())
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


def _causal_dirs() -> list[Path]:
    dirs = [d for d in MODEL_DIRS
            if load_hyperyaml(next(d.glob("cosyvoice*.yaml")))["hift"].cls == "CausalHiFTGenerator"]
    assert dirs, "no CausalHiFTGenerator model in the fixtures"
    return dirs


def test_v3_f0_predictor_is_float64():
    for model_dir in _causal_dirs():
        model = _load(model_dir)[0]
        assert all(p.dtype == torch.float64 for p in model.f0_predictor.parameters())
        assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if not n.startswith("f0_predictor."))


def _state_and_model(model_dir):
    config = load_hyperyaml(next(model_dir.glob("cosyvoice*.yaml")))
    noise = cosyvoice3_noise(config) if config["hift"].cls == "CausalHiFTGenerator" else None
    return _hift_state(model_dir), build_hift(config, noise)


def test_missing_and_unexpected_keys_are_named():
    state, model = _state_and_model(MODEL_DIRS[0])
    state.pop("conv_post.bias")
    state.pop("ups.0.parametrizations.weight.original1")
    state["extra.weight"] = torch.zeros(1)
    with pytest.raises(ModelLoadError) as err:
        convert_state_dict(state, model, "hift.pt")
    message = str(err.value)
    assert "conv_post.bias" in message and "ups.0.parametrizations.weight.original0" in message
    assert "extra.weight" in message and "ups.0.parametrizations.weight.original1" in message


def test_wrong_shape_is_named():
    state, model = _state_and_model(MODEL_DIRS[0])
    state["m_source.l_linear.weight"] = torch.zeros(1, 4)
    with pytest.raises(ModelLoadError, match="m_source.l_linear.weight"):
        convert_state_dict(state, model, "hift.pt")
    state, model = _state_and_model(MODEL_DIRS[0])
    key = "conv_pre.parametrizations.weight.original1"
    state[key] = state[key][:, :-1]
    with pytest.raises(ModelLoadError, match="conv_pre"):
        convert_state_dict(state, model, "hift.pt")


def test_missing_or_truncated_checkpoint(tmp_path):
    model_dir = MODEL_DIRS[0]
    with pytest.raises(ModelLoadError, match="missing"):
        _load(model_dir, tmp_path / "hift.pt")
    data = (model_dir / "hift.pt").read_bytes()
    (tmp_path / "hift.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="hift.pt"):
        _load(model_dir, tmp_path / "hift.pt")


def test_causal_hift_needs_its_noise():
    config = load_hyperyaml(next(_causal_dirs()[0].glob("cosyvoice*.yaml")))
    with pytest.raises(ModelLoadError, match="noise"):
        build_hift(config)


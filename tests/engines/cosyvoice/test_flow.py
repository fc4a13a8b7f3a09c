"""The flow (tokens + voice prompt -> mel) against upstream: every recorded flow call reproducible standalone.

Reproducible standalone: every CosyVoice 2 call (its noise is the fixed seed-0 buffer), and
CosyVoice 1 calls of cases without LM draws (voice conversion): the request generator is
seeded with the case seed and the flow draws randn_like(mu) first; between streaming chunks
the vocoder draws (rand (1, H, 1), randn (1, H, L), randn (1, L, 1) with H = harmonics + 1 and
L the call's source length, upstream's order), replayed here by drawing those shapes. v1 cases
with LM draws are covered end to end by the engine tests.

The fixtures were recorded where MKL ran its Intel code paths; on other CPUs (AMD) MKL's sgemm
rounds differently in the last bit and the mel moves by up to 5e-6 (upstream's own flow, run on
such a CPU, gives exactly what this implementation gives there). The suite's
`mizuoto.testing.mkl_intel` plugin puts MKL on its Intel paths, so the check is `torch.equal`;
where it could not, the parity tests fail saying so. The cases were recorded on one CPU class
(mizuoto.testing.cpu_recordings): on a class they were not recorded on, the mel is compared within
the spread upstream's own flow mel shows between the recorded classes (kind `seg.<i>.flow.<i>.mel`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from mizuoto.engines.cosyvoice.flow import (CausalMaskedDiffWithXvec, MaskedDiffWithXvec, build_flow,
                                            load_flow_weights)
from mizuoto.nn.flow.cfm import FIXED_NOISE_SHAPE, fixed_noise
from mizuoto.errors import InvalidRequest, ModelLoadError
from mizuoto.runtime.hyperyaml import load_hyperyaml
from mizuoto.testing.cosyvoice_cases import CaseRef, list_cases, load_case
from mizuoto.testing.cpu_recordings import FLOW_MEL, tree_comparison
from mizuoto.testing.fixtures import fixtures_root
from mizuoto.testing.mkl_intel import require_intel_path

SUPPORTED = {"CausalMaskedDiffWithXvec", "MaskedDiffWithXvec"}


def _flow_class(model_dir: Path) -> str:
    return load_hyperyaml(next(model_dir.glob("cosyvoice*.yaml")))["flow"].cls


def _standalone(ref: CaseRef) -> bool:
    """A case whose flow calls can be replayed without its LM (see the module docstring)."""
    meta = json.loads(ref.json_path.read_text())
    if not meta.get("flow_calls"):
        return False
    cls = _flow_class(ref.model_dir)
    if cls == "CausalMaskedDiffWithXvec":
        return True
    return cls == "MaskedDiffWithXvec" and meta.get("lm_tokens_raw_len", 0) == 0


CASES = [ref for ref in list_cases() if _flow_class(ref.model_dir) in SUPPORTED and _standalone(ref)]
CALLS = [(ref, i) for ref in CASES for i in range(len(json.loads(ref.json_path.read_text())["flow_calls"]))]
MODEL_DIRS = sorted({ref.model_dir for ref in list_cases() if _flow_class(ref.model_dir) in SUPPORTED})
# loading and sizes: every model dir, CosyVoice 3's DiT flow included (its mel is checked end to
# end in test_cases.py)
ALL_DIRS = sorted({ref.model_dir for ref in list_cases()})


def _load_flow(model_dir: Path):
    config = load_hyperyaml(next(model_dir.glob("cosyvoice*.yaml")))
    return load_flow_weights(build_flow(config), model_dir / "flow.pt"), config


def _prompt(case, name: str, empty: torch.Tensor) -> torch.Tensor:
    value = case.input(name)
    return empty if value is None else value


def _run_case(ref: CaseRef) -> list[dict]:
    """Every flow call of one case, in order, compared with upstream's mel."""
    case = load_case(ref)
    flow, config = _load_flow(ref.model_dir)
    prompt_token = _prompt(case, "flow_prompt_speech_token", torch.zeros(1, 0, dtype=torch.int32))
    prompt_feat = _prompt(case, "prompt_speech_feat", torch.zeros(1, 0, flow.output_size))
    embedding = case.input("flow_embedding")
    generator = torch.Generator().manual_seed(case.seed)
    cache = None
    rows = []
    for i, call in enumerate(case.meta["flow_calls"]):
        token = case[f"flow.{i}.token"]
        if isinstance(flow, CausalMaskedDiffWithXvec):
            mel = flow.inference(token, prompt_token, prompt_feat, embedding,
                                 streaming=call["streaming"], finalize=call["finalize"])
        else:
            mel, cache = flow.inference(token, prompt_token, prompt_feat, embedding, cache, generator)
            source_len = case[f"hift.{i}.source"].shape[-1]
            harmonics = config["hift"]["nb_harmonics"] + 1
            torch.rand(1, harmonics, 1, generator=generator)
            torch.randn(1, harmonics, source_len, generator=generator)
            torch.randn(1, source_len, 1, generator=generator)
        want = case[f"flow.{i}.mel"]
        rows.append({"mel": mel, "upstream": want, "shape": list(mel.shape), "want": list(want.shape)})
    return rows


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict]]:
    require_intel_path()
    return {ref.id: _run_case(ref) for ref in CASES}


def test_cases_were_found():
    assert ALL_DIRS and {_flow_class(d) for d in ALL_DIRS} <= SUPPORTED | {"CausalMaskedDiffWithDiT"}
    assert any(_flow_class(r.model_dir) == "CausalMaskedDiffWithXvec" for r in CASES), "no v2 flow case found"
    assert CALLS


@pytest.mark.parametrize("ref,call", CALLS, ids=[f"{ref.id}-flow{i}" for ref, i in CALLS])
def test_flow_mel_equals_upstream(results, ref, call):
    rows = results[ref.id]
    assert len(rows) > call, f"{ref.id}: flow call {call} did not run"
    row = rows[call]
    assert row["shape"] == row["want"], f"{ref.id} flow {call}: mel shape {row['shape']}, upstream {row['want']}"
    tree_comparison("cosyvoice").assert_equal(row["mel"], row["upstream"], FLOW_MEL, f"{ref.id} flow {call} mel")


# --- fixed noise ------------------------------------------------------------------------------

def _noise_records() -> list[tuple[Path, dict]]:
    found = []
    for path in sorted((fixtures_root() / "cosyvoice").glob("*/cases/*.json")):
        meta = json.loads(path.read_text())
        if "flow.decoder.rand_noise" in meta.get("sha256_full", {}):
            found.append((path, meta))
    return found


NOISE = _noise_records()


def test_noise_records_were_found():
    assert NOISE


@pytest.mark.parametrize("path,meta", NOISE, ids=[f"{p.parent.parent.name}-{p.stem}" for p, _ in NOISE])
def test_fixed_noise_is_upstreams_seed0_buffer(path, meta):
    from safetensors.torch import load_file

    noise = fixed_noise()
    assert tuple(noise.shape) == FIXED_NOISE_SHAPE
    assert hashlib.sha256(noise.numpy().tobytes()).hexdigest() == meta["sha256_full"]["flow.decoder.rand_noise"]
    for name, stored in load_file(str(path.with_suffix(".safetensors"))).items():
        if name.startswith("flow.decoder.rand_noise"):
            assert torch.equal(noise[:, :, :stored.shape[-1]], stored), name


def test_fixed_noise_is_generated_once():
    assert fixed_noise() is fixed_noise()


# --- building and loading ---------------------------------------------------------------------

@pytest.mark.parametrize("model_dir", ALL_DIRS, ids=[d.parent.name for d in ALL_DIRS])
def test_flow_pt_loads_strictly_with_upstream_keys(model_dir):
    flow, _ = _load_flow(model_dir)
    state = torch.load(model_dir / "flow.pt", weights_only=True)
    assert list(flow.state_dict()) == list(state)
    for key, value in flow.state_dict().items():
        assert torch.equal(value, state[key]), key
    assert not flow.training


@pytest.mark.parametrize("model_dir", ALL_DIRS, ids=[d.parent.name for d in ALL_DIRS])
def test_sizes_come_from_the_yaml(model_dir):
    config = load_hyperyaml(next(model_dir.glob("cosyvoice*.yaml")))
    flow = build_flow(config)
    node = config["flow"]
    assert flow.input_embedding.weight.shape == (node["vocab_size"], node["input_size"])
    assert flow.decoder.inference_cfg_rate == node["decoder"]["cfm_params"]["content"]["inference_cfg_rate"]
    est_node, estimator = node["decoder"]["estimator"], flow.decoder.estimator
    if node.cls == "CausalMaskedDiffWithDiT":
        layer = node["pre_lookahead_layer"]
        assert flow.pre_lookahead_layer.conv1.weight.shape == (layer["channels"], layer["in_channels"],
                                                               layer["pre_lookahead_len"] + 1)
        assert flow.pre_lookahead_len == node["pre_lookahead_len"] and flow.token_mel_ratio == node["token_mel_ratio"]
        assert len(estimator.transformer_blocks) == est_node["depth"]
        assert estimator.proj_out.weight.shape == (est_node["mel_dim"], est_node["dim"])
        assert estimator.transformer_blocks[0].attn.heads == est_node["heads"]
        assert estimator.transformer_blocks[0].attn.to_q.weight.shape == (est_node["heads"] * est_node["dim_head"],
                                                                         est_node["dim"])
        return
    assert flow.encoder.output_size() == node["encoder"]["output_size"]
    assert estimator.in_channels == est_node["in_channels"]


def test_missing_and_unexpected_keys_are_named(tmp_path):
    model_dir = MODEL_DIRS[0]
    state = torch.load(model_dir / "flow.pt", weights_only=True)
    dropped = next(iter(state))
    state.pop(dropped)
    state["decoder.rand_noise"] = torch.zeros(1)
    torch.save(state, tmp_path / "flow.pt")
    config = load_hyperyaml(next(model_dir.glob("cosyvoice*.yaml")))
    with pytest.raises(ModelLoadError) as err:
        load_flow_weights(build_flow(config), tmp_path / "flow.pt")
    assert dropped in str(err.value) and "decoder.rand_noise" in str(err.value)
    assert "missing" in str(err.value) and "unexpected" in str(err.value)


def test_shape_mismatch_is_named(tmp_path):
    model_dir = MODEL_DIRS[0]
    state = torch.load(model_dir / "flow.pt", weights_only=True)
    state["encoder_proj.bias"] = torch.zeros(3)
    torch.save(state, tmp_path / "flow.pt")
    config = load_hyperyaml(next(model_dir.glob("cosyvoice*.yaml")))
    with pytest.raises(ModelLoadError, match="encoder_proj.bias"):
        load_flow_weights(build_flow(config), tmp_path / "flow.pt")


def test_missing_or_truncated_flow_pt_is_a_clear_error(tmp_path):
    model_dir = MODEL_DIRS[0]
    config = load_hyperyaml(next(model_dir.glob("cosyvoice*.yaml")))
    with pytest.raises(ModelLoadError, match="not found"):
        load_flow_weights(build_flow(config), tmp_path / "flow.pt")
    data = (model_dir / "flow.pt").read_bytes()
    (tmp_path / "flow.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="cannot read"):
        load_flow_weights(build_flow(config), tmp_path / "flow.pt")


def test_unknown_flow_class_and_options_are_refused():
    model_dir = MODEL_DIRS[0]
    config = load_hyperyaml(next(model_dir.glob("cosyvoice*.yaml")))
    renamed = dict(config, flow=type(config["flow"])("new", "somewhere.UnknownFlow", config["flow"].kwargs))
    with pytest.raises(ModelLoadError, match="UnknownFlow"):
        build_flow(renamed)
    encoder = config["flow"]["encoder"]
    odd_encoder = type(encoder)("new", encoder.target, dict(encoder.kwargs, frobnicate=3))
    odd = dict(config, flow=type(config["flow"])("new", config["flow"].target,
                                                  dict(config["flow"].kwargs, encoder=odd_encoder)))
    with pytest.raises(ModelLoadError, match="frobnicate"):
        build_flow(odd)


def test_batched_and_overlong_requests_are_refused():
    v2 = [d for d in MODEL_DIRS if _flow_class(d) == "CausalMaskedDiffWithXvec"]
    flow, _ = _load_flow(v2[0])
    with pytest.raises(InvalidRequest, match="tokens"):
        flow.inference(torch.zeros(2, 5, dtype=torch.int32), torch.zeros(1, 0, dtype=torch.int32),
                       torch.zeros(1, 0, 80), torch.randn(1, 192))
    flow.check_frames(FIXED_NOISE_SHAPE[2])
    with pytest.raises(InvalidRequest, match="mel frames"):
        flow.check_frames(FIXED_NOISE_SHAPE[2] + 1)


def test_v1_noise_comes_from_the_request_generator():
    v1 = [d for d in MODEL_DIRS if _flow_class(d) == "MaskedDiffWithXvec"]
    assert v1
    flow, _ = _load_flow(v1[0])
    assert isinstance(flow, MaskedDiffWithXvec)
    token = torch.arange(10, dtype=torch.int32)[None]
    empty_token, empty_feat = torch.zeros(1, 0, dtype=torch.int32), torch.zeros(1, 0, flow.output_size)
    embedding = torch.randn(1, flow.spk_embed_affine_layer.in_features, generator=torch.Generator().manual_seed(1))

    def run(seed):
        return flow.inference(token, empty_token, empty_feat, embedding, generator=torch.Generator().manual_seed(seed))

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # not a parity check; tiny ops on a busy machine are faster unthreaded
    try:
        (a, cache_a), (b, _), (c, _) = run(3), run(3), run(4)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.shape == (1, flow.output_size, flow.mel_frames(10))
    assert cache_a.shape[-1] == 2

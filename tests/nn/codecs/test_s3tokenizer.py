"""Speech tokenizers v1-v3 built from the ONNX files vs onnxruntime's recorded outputs."""

import json
import re
import shutil

import onnx
import pytest
import torch
from safetensors.torch import load_file

import mizuoto.runtime.convert.onnx as conv
from mizuoto.runtime.convert.s3tokenizer import load_s3tokenizer
from mizuoto.errors import InvalidRequest
from mizuoto.testing.cpu_recordings import FRONT_END, tree_comparison
from mizuoto.testing.fixtures import fixture_path
from mizuoto.testing.mkl_intel import require_intel_path

MARGIN = 1e-4
HIDDEN_REL = 1e-4
_FRONTEND = fixture_path("frontend")
_CLIPS = sorted(json.loads((_FRONTEND / "manifest.json").read_text())["clips"])
# every tokenizer in the models folder, with the version its file name carries (tokens_<version>)
_MODELS = sorted((m.group(1), p.name) for p in (_FRONTEND / "models").glob("*.onnx")
                 if (m := re.fullmatch(r"speech_tokenizer_(v\d+)", p.stem)))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tokenizers, loaded from copies of the ONNX files (the cache lands beside the copies)."""
    home = tmp_path_factory.mktemp("models")
    out = {}
    for version, name in _MODELS:
        shutil.copy(_FRONTEND / "models" / name, home / name)
        out[version] = load_s3tokenizer(home / name)
    return out


@pytest.fixture(scope="module")
def refs():
    return {clip: load_file(str(_FRONTEND / "refs" / f"{clip}.safetensors")) for clip in _CLIPS}


def test_models_and_clips_were_found():
    assert _MODELS and _CLIPS


def _margins(ref: dict, version: str) -> torch.Tensor:
    if f"{version}_top2_scores" in ref:
        top2 = ref[f"{version}_top2_scores"]
        return top2[:, 0] - top2[:, 1]
    z = ref[f"{version}_fsq_z"].reshape(-1, ref[f"{version}_fsq_z"].shape[-1])
    return (z.abs() - 0.5).abs().min(dim=-1).values


@pytest.mark.parametrize("version", [v for v, _ in _MODELS])
@pytest.mark.parametrize("clip", _CLIPS)
def test_tokens_and_hidden_states_match_onnxruntime(models, refs, version, clip):
    model, ref = models[version], refs[clip]
    with torch.inference_mode():
        hidden, lengths = model.encode(ref["whisper_logmel128"])
        tokens = model.quantize(hidden)
    expected_hidden = ref[f"{version}_hidden"]
    assert hidden.shape == expected_hidden.shape
    rel = ((hidden - expected_hidden).abs().max() / expected_hidden.abs().max()).item()
    assert rel <= HIDDEN_REL, f"hidden states differ by {rel:.2e} relative"
    expected = ref[f"tokens_{version}"].reshape(-1)
    assert tokens.dtype == torch.int64 and tokens.numel() == expected.numel() == int(lengths[0])
    margin = _margins(ref, version)
    differ = tokens.reshape(-1) != expected
    near = margin < MARGIN
    print(f"{version} {clip}: {expected.numel()} tokens, hidden rel {rel:.1e}, "
          f"{int(near.sum())} frames under margin {MARGIN}, {int((differ & near).sum())} of them differ")
    far = torch.nonzero(differ & ~near).reshape(-1)
    assert far.numel() == 0, (f"{far.numel()} tokens differ above the margin, first at frame {int(far[0])} "
                              f"(margin {float(margin[far[0]]):.2e})")


@pytest.mark.parametrize("version", [v for v, _ in _MODELS])
def test_every_size_comes_from_the_onnx_file(models, version):
    graph = onnx.load(str(_FRONTEND / "models" / dict(_MODELS)[version])).graph
    shapes = {t.name: tuple(t.dims) for t in graph.initializer}
    weight_of = {n.name: shapes.get(n.input[1]) for n in graph.node if len(n.input) > 1}
    model = models[version]
    assert tuple(model.conv1.weight.shape) == weight_of["/conv1/Conv"]
    blocks = {m.group(1) for n in graph.node if (m := re.match(r"/blocks\.(\d+)/", n.name))}
    assert len(model.blocks) == len(blocks)
    assert tuple(model.blocks[0].mlp[0].weight.shape) == weight_of["/blocks.0/mlp/mlp.0/MatMul"][::-1]


@pytest.mark.parametrize("version", [v for v, _ in _MODELS])
def test_more_than_30_seconds_is_a_clear_error(models, version):
    model = models[version]
    mel = torch.zeros(1, model.conv1.in_channels, model.max_frames + 1)
    with pytest.raises(InvalidRequest, match="30 s"):
        model(mel)
    with torch.inference_mode():
        tokens, lengths = model(mel[..., :-1])  # exactly 30 s is fine
    assert tokens.shape[-1] == int(lengths[0]) > 0


@pytest.mark.parametrize("version", [v for v, _ in _MODELS])
def test_a_padded_batch_tokenizes_each_item_like_alone(models, refs, version):
    model = models[version]
    mels = [refs[clip]["whisper_logmel128"][0] for clip in _CLIPS[:2]]
    longest = max(m.shape[-1] for m in mels)
    batch = torch.stack([torch.nn.functional.pad(m, (0, longest - m.shape[-1])) for m in mels])
    lengths = torch.tensor([m.shape[-1] for m in mels])
    with torch.inference_mode():
        tokens, token_lengths = model(batch, lengths)
        for i, mel in enumerate(mels):
            alone, n = model(mel[None])
            assert int(token_lengths[i]) == int(n[0])
            margin = _margins(refs[_CLIPS[i]], version)
            same = tokens[i, : int(n[0])] == alone[0]
            assert bool(same[margin >= MARGIN].all())


def test_the_second_load_reads_the_cache(tmp_path, monkeypatch):
    version, name = _MODELS[0]
    shutil.copy(_FRONTEND / "models" / name, tmp_path / name)
    parses = []
    real = conv._parse_onnx
    monkeypatch.setattr(conv, "_parse_onnx", lambda p, progress: parses.append(p) or real(p, progress))
    first = load_s3tokenizer(tmp_path / name)
    second = load_s3tokenizer(tmp_path / name)
    assert len(parses) == 1
    a, b = first.state_dict(), second.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("clip", _CLIPS)
def test_end_to_end_from_the_wav_file(models, refs, clip):
    """wav -> load_wav(16 kHz) -> Whisper log-mel (ours) -> tokens, against onnxruntime's tokens.

    The log-mel from the wav is the recorded one bit for bit (MKL on the recording machine's
    code paths, see tests/nn/dsp/test_mel.py), so the tokens are those of the recorded mel. On a
    CPU class the references were not recorded on, the log-mel is within the front end's measured
    spread (mizuoto.testing.cpu_recordings); the tokens, integers, stay equal.
    """
    from mizuoto.nn.dsp import load_wav, whisper_log_mel

    require_intel_path()
    info = json.loads((_FRONTEND / "manifest.json").read_text())["clips"][clip]
    mel = whisper_log_mel(load_wav(_FRONTEND / info["wav"], 16000), 128)
    tree_comparison("frontend").assert_equal(mel, refs[clip]["whisper_logmel128"], FRONT_END,
                                             f"{clip} whisper_logmel128 from wav")
    for version, model in models.items():
        with torch.inference_mode():
            tokens, _ = model(mel)
            from_ref, _ = model(refs[clip]["whisper_logmel128"])
        assert torch.equal(tokens, from_ref)
        expected = refs[clip][f"tokens_{version}"].reshape(-1)
        differ = tokens.reshape(-1) != expected
        far = differ & (_margins(refs[clip], version) >= MARGIN)
        print(f"{version} {clip} from wav: {int(differ.sum())} of {expected.numel()} tokens differ")
        assert not bool(far.any()), f"{version}: {int(far.sum())} tokens differ above the margin"


@pytest.mark.parametrize("version", [v for v, _ in _MODELS])
def test_biases_held_as_constant_nodes_convert_the_same(tmp_path, version):
    """Released v3 files keep some biases in Constant nodes instead of initializers."""
    from onnx import helper

    from mizuoto.runtime.convert.s3tokenizer import read_s3tokenizer

    source = _FRONTEND / "models" / dict(_MODELS)[version]
    model = onnx.load(str(source))
    vectors = [t for t in model.graph.initializer if len(t.dims) == 1]
    for t in vectors:
        model.graph.initializer.remove(t)
        model.graph.node.insert(0, helper.make_node("Constant", [], [t.name], value=t))
    onnx.save(model, str(tmp_path / source.name))
    _, expected = read_s3tokenizer(conv.load_graph(source))
    _, got = read_s3tokenizer(conv.load_graph(tmp_path / source.name))
    assert vectors and expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)

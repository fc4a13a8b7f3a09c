"""CAM++ built from campplus.onnx vs onnxruntime's recorded embeddings.

The recorded features and embeddings were made on one CPU class (mizuoto.testing.cpu_recordings):
there the checks hold as written; on a class they were not recorded on, features may differ by
the front end's measured spread (full-pipeline kind `seg.<i>.input.prompt_speech_feat`) and an
embedding by upstream's measured embedding spread (`seg.<i>.input.llm_embedding`), added to the
check's own tolerance.
"""

import json
import re
import shutil

import onnx
import pytest
import torch
from safetensors.torch import load_file

import mizuoto.nn.speaker.campplus_ort as ort_order
import mizuoto.runtime.convert.onnx as conv
from mizuoto.runtime.convert.campplus import load_campplus
from mizuoto.nn.speaker.campplus import CAMPPlus
from mizuoto.runtime.convert.campplus import node_scope
from mizuoto.testing.cpu_recordings import EMBEDDING, FRONT_END, tree_comparison
from mizuoto.testing.fixtures import fixture_path
from mizuoto.testing.mkl_intel import require_intel_path

REL = 1e-5
_FRONTEND = fixture_path("frontend")
_CLIPS = sorted(json.loads((_FRONTEND / "manifest.json").read_text())["clips"])
_ONNX = _FRONTEND / "models" / "campplus.onnx"  # the file name upstream model dirs use


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    home = tmp_path_factory.mktemp("campplus")
    shutil.copy(_ONNX, home / _ONNX.name)
    return load_campplus(home / _ONNX.name)


@pytest.mark.parametrize("clip", _CLIPS)
def test_embedding_matches_onnxruntime(model, clip):
    ref = load_file(str(_FRONTEND / "refs" / f"{clip}.safetensors"))
    expected = ref["campplus_embedding"]
    with torch.inference_mode():
        emb = model(ref["kaldi_fbank_cmn"].unsqueeze(0))
    assert emb.shape == expected.shape and emb.dtype == torch.float32
    rel = ((emb - expected).abs().max() / expected.abs().max()).item()
    print(f"{clip}: T={ref['kaldi_fbank_cmn'].shape[0]} max|ours-ort|/max|ort| = {rel:.2e}")
    assert rel <= REL


def test_it_is_a_fixed_cpu_module(model):
    assert CAMPPlus.fixed_device == torch.device("cpu")
    assert model.device == CAMPPlus.fixed_device
    assert not model.training


def test_a_2d_input_is_one_utterance(model):
    clips = json.loads((_FRONTEND / "manifest.json").read_text())["clips"]
    shortest = min(clips, key=lambda c: clips[c]["num_samples"] / clips[c]["sample_rate"])
    ref = load_file(str(_FRONTEND / "refs" / f"{shortest}.safetensors"))
    with torch.inference_mode():
        assert torch.equal(model(ref["kaldi_fbank_cmn"]), model(ref["kaldi_fbank_cmn"][None]))


def test_sizes_and_layers_come_from_the_graph(model):
    graph = onnx.load(str(_ONNX)).graph
    shapes = {t.name: tuple(t.dims) for t in graph.initializer}
    weights = {n.name: shapes[n.input[1]] for n in graph.node
               if n.op_type == "Conv" and n.input[1] in shapes}
    convs = {path: m for path, m in model.named_modules() if isinstance(m, (torch.nn.Conv1d, torch.nn.Conv2d))}
    assert len(convs) == len(weights)
    for path, module in convs.items():
        assert tuple(module.weight.shape) == weights[f"{node_scope(path)}/Conv"], path
    layers = {m.group(0) for n in graph.node if (m := re.match(r"/xvector/block\d+/tdnnd\d+/", n.name))}
    assert sum(1 for p, _ in model.named_modules() if re.fullmatch(r"xvector\.block\d+\.tdnnd\d+", p)) == len(layers)


def test_node_scope():
    assert node_scope("head.layer1.0.shortcut.0") == "/head/layer1/layer1.0/shortcut/shortcut.0"
    assert node_scope("xvector.block2.tdnnd3.linear1") == "/xvector/block2/tdnnd3/linear1"


def test_the_second_load_reads_the_cache(tmp_path, monkeypatch):
    shutil.copy(_ONNX, tmp_path / _ONNX.name)
    parses = []
    real = conv._parse_onnx
    monkeypatch.setattr(conv, "_parse_onnx", lambda p, progress: parses.append(p) or real(p, progress))
    a = load_campplus(tmp_path / _ONNX.name).state_dict()
    b = load_campplus(tmp_path / _ONNX.name).state_dict()
    assert len(parses) == 1 and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("clip", _CLIPS)
def test_end_to_end_from_the_wav_file(model, clip):
    """wav -> load_wav(16 kHz) -> kaldi fbank + CMN (ours) -> CAM++, against onnxruntime's embedding.

    The features from the wav are the recorded ones bit for bit (MKL on the recording machine's
    code paths, see tests/nn/dsp/test_kaldi.py), so the embedding meets the same bound as from
    the recorded features: max|ours - ort| / max|ort| <= REL.
    """
    from mizuoto.nn.dsp import kaldi_fbank, load_wav, mean_normalize

    require_intel_path()
    info = json.loads((_FRONTEND / "manifest.json").read_text())["clips"][clip]
    ref = load_file(str(_FRONTEND / "refs" / f"{clip}.safetensors"))
    cpu = tree_comparison("frontend")
    feats = mean_normalize(kaldi_fbank(load_wav(_FRONTEND / info["wav"], 16000)))
    cpu.assert_equal(feats, ref["kaldi_fbank_cmn"], FRONT_END, f"{clip} kaldi_fbank_cmn from wav", log=True)
    expected = ref["campplus_embedding"]
    with torch.inference_mode():
        emb = model(feats)
    assert emb.shape == expected.shape
    diff = (emb - expected).abs().max().item()
    rel = diff / expected.abs().max().item()
    limit = REL * expected.abs().max().item() + cpu.bound(EMBEDDING, expected)  # plus upstream's spread, unrecorded
    print(f"{clip} from wav: max|ours-ort|/max|ort| = {rel:.2e}")
    assert diff <= limit, f"{clip} from wav: max abs diff {diff:.3g} (relative {rel:.2e}) > {limit:.3g}"


@pytest.fixture
def one_thread():
    """forward_ort_order is thousands of small elementwise steps: unthreaded is far faster (as the
    features stage runs it); its numbers do not depend on the thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("clip", _CLIPS)
@pytest.mark.usefixtures("one_thread")
def test_onnxruntime_order_gives_onnxruntimes_embedding(model, clip):
    """forward_ort_order (the training features' CAM++) reproduces onnxruntime's float32 numbers."""
    ref = load_file(str(_FRONTEND / "refs" / f"{clip}.safetensors"))
    expected = ref["campplus_embedding"]
    emb = ort_order.forward_ort_order(model, ref["kaldi_fbank_cmn"].unsqueeze(0))
    assert emb.shape == expected.shape and emb.dtype == torch.float32
    diff = (emb - expected).abs().max().item()
    print(f"{clip}: T={ref['kaldi_fbank_cmn'].shape[0]} onnxruntime order: max|ours-ort| = {diff:.3g}")
    cpu = tree_comparison("frontend")
    if ort_order._fused_addcmul():
        cpu.assert_equal(emb, expected, EMBEDDING, f"{clip} onnxruntime-order embedding")
    else:  # float64 steps round twice: a rare one-ulp difference may remain
        limit = 6e-6 + cpu.bound(EMBEDDING, expected)  # plus upstream's own spread where unrecorded
        assert diff <= limit, f"{clip} onnxruntime-order embedding: max abs diff {diff:.3g} > {limit:.3g}"


@pytest.mark.usefixtures("one_thread")
def test_onnxruntime_order_float64_steps_give_the_same_numbers(model, monkeypatch):
    """Without a fused float32 addcmul the chains step in float64; the result is the same."""
    clips = json.loads((_FRONTEND / "manifest.json").read_text())["clips"]
    shortest = min(clips, key=lambda c: clips[c]["num_samples"] / clips[c]["sample_rate"])
    feats = load_file(str(_FRONTEND / "refs" / f"{shortest}.safetensors"))["kaldi_fbank_cmn"]
    first = ort_order.forward_ort_order(model, feats)
    monkeypatch.setattr(ort_order, "_fused_addcmul", lambda: False)
    assert torch.equal(ort_order.forward_ort_order(model, feats), first)


def test_nchwc_block_follows_the_cpu_unless_steered(monkeypatch):
    """MLAS's block: 16 channels on an AVX-512 CPU, else 8; $MIZUOTO_ORT_NCHWC_BLOCK takes another CPU's."""
    monkeypatch.delenv(ort_order.NCHWC_BLOCK_ENV, raising=False)
    for avx512, block in ((True, 16), (False, 8)):
        monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: avx512)
        assert ort_order._nchwc_block() == block
    monkeypatch.setenv(ort_order.NCHWC_BLOCK_ENV, "16")
    assert ort_order._nchwc_block() == 16
    monkeypatch.setenv(ort_order.NCHWC_BLOCK_ENV, "32")
    with pytest.raises(ValueError, match="8 or 16"):
        ort_order._nchwc_block()


@pytest.mark.usefixtures("one_thread")
def test_the_nchwc_block_changes_the_numbers(model, monkeypatch):
    """The head's convolutions sum 8-channel blocks differently from 16-channel ones: the block matters,
    so an AVX2 CPU (where onnxruntime uses 8) must not take the AVX-512 order, nor the reverse."""
    clips = json.loads((_FRONTEND / "manifest.json").read_text())["clips"]
    shortest = min(clips, key=lambda c: clips[c]["num_samples"] / clips[c]["sample_rate"])
    feats = load_file(str(_FRONTEND / "refs" / f"{shortest}.safetensors"))["kaldi_fbank_cmn"]
    monkeypatch.setattr(ort_order, "NCHWC_BLOCK", 16)
    sixteen = ort_order.forward_ort_order(model, feats)
    monkeypatch.setattr(ort_order, "NCHWC_BLOCK", 8)
    eight = ort_order.forward_ort_order(model, feats)
    assert not torch.equal(sixteen, eight)
    assert ((sixteen - eight).abs().max() / sixteen.abs().max()).item() <= REL


def test_without_avx2_the_exact_order_is_refused(model, monkeypatch):
    """A CPU without AVX2/FMA3 runs onnxruntime's non-fused kernels, which are not reproduced: an error."""
    monkeypatch.setattr(torch.cpu, "_is_avx2_supported", lambda: False)
    assert not ort_order.reproducible_here()
    with pytest.raises(RuntimeError, match="AVX2"):
        ort_order.forward_ort_order(model, torch.zeros(50, 80))


def _eigen_row_sums(x: torch.Tensor, first_row: int) -> torch.Tensor:
    """Eigen's vectorised row sum, one alignment group of rows at a time (the rule as written)."""
    rows, n = x.shape
    sums = torch.empty(rows)
    for start in range(4):
        idx = [r for r in range(rows) if min((-(first_row + r) * n) % 4, n) == start]
        if not idx:
            continue
        xs = x[idx]
        vec = ((n - start) // 4) * 4
        if vec == 0:
            res = xs[:, 0]
            for i in range(1, n):
                res = res + xs[:, i]
        else:
            p0 = xs[:, start:start + 4]
            if vec > 4:
                pairs = ((n - start) // 8) * 8
                p1 = xs[:, start + 4:start + 8]
                for i in range(start + 8, start + pairs, 8):
                    p0 = p0 + xs[:, i:i + 4]
                    p1 = p1 + xs[:, i + 4:i + 8]
                p0 = p0 + p1
                if vec > pairs:
                    p0 = p0 + xs[:, start + pairs:start + pairs + 4]
            res = (p0[:, 0] + p0[:, 2]) + (p0[:, 1] + p0[:, 3])
            for i in list(range(start)) + list(range(start + vec, n)):
                res = res + xs[:, i]
        sums[idx] = res
    return sums


@pytest.mark.parametrize("n", [*range(1, 20), 31, 97, 128, 511, 1198])
def test_row_means_step_every_alignment_together_as_eigen_orders_each(n):
    """All rows' packets stepped at once give each row's own Eigen order, whatever its alignment."""
    g = torch.Generator().manual_seed(n)
    for rows, first_row in ((1, 0), (5, 3), (13, 6), (128, 1)):
        x = torch.randn(rows, n, generator=g) * torch.logspace(-3, 3, n)[torch.randperm(n, generator=g)]
        got = ort_order.row_means(x, first_row)
        assert torch.equal(got, _eigen_row_sums(x, first_row) / torch.tensor(float(n))), (rows, first_row)

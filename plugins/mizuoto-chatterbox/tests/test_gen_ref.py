"""S3Gen's clip conditioning against upstream: prompt tokens, prompt mel and CAM++ x-vector of each clone.

From the recorded 24 kHz reference (`s3gen_ref_wav`, what upstream's `embed_ref` got), the 16 kHz
resample, kaldi fbank, CAM++ and S3 tokenizer run here; their outputs must be torch.equal to the
recorded `s3gen_*` tensors (the resample and fbank have no recording of their own: both feed the
x-vector and the tokens, so any difference in them shows there).
"""

import functools
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mizuoto.errors import ModelLoadError
from mizuoto.nn.speaker import CAMPPlus
from mizuoto.nn.speaker.campplus_ort import forward_ort_order
from mizuoto.testing.mkl_intel import require_intel_path
from mizuoto_chatterbox.gen_ref import PREFIX, gen_reference, load_xvector
from mizuoto_chatterbox.voice import load_s3_tokenizer
from mizuoto_chatterbox.weights import S3GEN_FILES

CLONE_ONLY = ("s3gen_ref_wav", "clip_wav_16k", "ve_mel")


@functools.lru_cache(maxsize=None)
def _models(model_dir: Path):
    return load_s3_tokenizer(model_dir), load_xvector(model_dir)


_RUNS: dict[str, tuple] = {}


def _reference(case):
    """Computed once per case: three tests read it."""
    if case.name not in _RUNS:
        ref = case.tensors()
        _RUNS[case.name] = ref, gen_reference(ref["s3gen_ref_wav"], *_models(case.model_dir))
    return _RUNS[case.name]


def _clone(case):
    """(recorded tensors, our (prompt_token, prompt_feat, embedding)), or None for a preset (keys checked)."""
    if case.spec["mode"] != "clone":
        ref = case.tensors()
        assert not [k for k in CLONE_ONLY if k in ref], "a preset case recorded a clone's reference"
        return None
    require_intel_path()
    return _reference(case)


def test_xvector_equals_upstreams(case):
    got = _clone(case)
    if got is None:
        return
    ref, (_, _, embedding) = got
    assert embedding.dtype == torch.float32 and embedding.shape == ref["s3gen_embedding"].shape
    case.assert_equal(embedding, "s3gen_embedding")


def test_prompt_tokens_equal_upstreams(case):
    got = _clone(case)
    if got is None:
        return
    ref, (tokens, feat, _) = got
    assert tokens.dtype == torch.int64
    case.assert_equal(tokens, "s3gen_prompt_token")
    assert tokens.shape[1] == int(ref["s3gen_prompt_token_len"][0])
    assert feat.shape[1] in (2 * tokens.shape[1], 2 * tokens.shape[1] + 1)


def test_prompt_feat_equals_upstreams(case):
    got = _clone(case)
    if got is None:
        return
    ref, (_, feat, _) = got
    case.assert_equal(feat, "s3gen_prompt_feat")


def test_xvector_sizes_come_from_the_weights(case):
    """The unfolded CAM++ has every norm upstream has, and the reduced sizes stated beside the weights."""
    xvector = load_xvector(case.model_dir)
    assert not xvector.folded and not xvector.training
    assert xvector.device == CAMPPlus.fixed_device
    reduced = json.loads((case.model_dir / "reduced_config.json").read_text(encoding="utf-8"))["reduced"]
    sizes = reduced.get("campplus")
    if sizes:
        first = xvector.xvector.block1.tdnnd1
        assert xvector.xvector.tdnn.linear.out_channels == sizes["init_channels"]
        assert first.cam_layer.linear_local.out_channels == sizes["growth_rate"]
        assert first.linear1.out_channels == sizes["bn_size"] * sizes["growth_rate"]
    state = load_file(str(case.model_file(S3GEN_FILES)))
    mine = {PREFIX + k for k in xvector.state_dict()}
    theirs = {k for k in state if k.startswith(PREFIX) and not k.endswith(".num_batches_tracked")}
    assert mine == theirs


def test_onnxruntime_order_refuses_the_unfolded_layout(case):
    xvector = load_xvector(case.model_dir)
    with pytest.raises(ValueError, match="folded"):
        forward_ort_order(xvector, torch.zeros(1, 200, xvector.feat_dim))


def test_weights_without_a_speaker_encoder_are_refused(case, tmp_path):
    src = case.model_file(S3GEN_FILES)
    state = load_file(str(src))
    save_file({k: v for k, v in state.items() if not k.startswith(PREFIX + "xvector.dense.")},
              str(tmp_path / src.name))
    with pytest.raises(ModelLoadError, match="dense"):
        load_xvector(tmp_path)

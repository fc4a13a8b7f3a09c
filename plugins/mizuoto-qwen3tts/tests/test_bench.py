"""`mizuoto bench` on Qwen3-TTS: the engine's own stage calls timed, exactly the frames asked for (no timings)."""

import json
import os
from pathlib import Path

import pytest
import torch

# conftest.py's tree (its module is not importable from here)
ROOT = Path(os.environ.get("MIZUOTO_QWEN3TTS_FIXTURES", Path(__file__).parent / "fixtures"))

FRAME_SECONDS = 1920 / 24000


def _bench(capsys, *args: str) -> dict:
    from mizuoto.cli.main import main

    assert main(["bench", *args, "--tokens", "3", "--runs", "1", "--warmup", "0", "--json"]) == 0, \
        capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("model", ["custom_voice", "base", "voice_design"])
def test_bench_times_the_engines_calls_and_streams(model, capsys):
    extra = ["--no-contract"] if model != "custom_voice" else []  # the contract run once is enough
    out = _bench(capsys, str(ROOT / "models" / model), "--stream", *extra)
    # the fixtures' talkers stop after a few frames by themselves: exactly 3 frames is the banned stop code's doing
    assert out["tokens"] == 3 and out["audio_seconds"] == pytest.approx(3 * FRAME_SECONDS)
    assert out["lm_ms_per_token"] > 0 and out["vocoder_ms_per_audio_second"] > 0 and out["first_chunk_ms"] > 0
    assert out["model"].startswith(f"qwen3tts {model}") and out["lm_bytes_per_step"] > 0
    assert ("contract" in out) == (model == "custom_voice")


@pytest.fixture
def tiny_random(monkeypatch):
    """random_model's sizes shrunk (the vocabularies kept: the stand-in tokenizer's ids are the released ones)."""
    from mizuoto_qwen3tts import random_model as rm

    small = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 1, "head_dim": 8}
    monkeypatch.setattr(rm, "TALKER", {size: {**cfg, **small, "text_hidden_size": 8, "rope_scaling": {
        "rope_type": "default", "interleaved": True, "mrope_section": [2, 1, 1]}} for size, cfg in rm.TALKER.items()})
    monkeypatch.setattr(rm, "PREDICTOR", {**rm.PREDICTOR, **small, "hidden_size": 8})
    monkeypatch.setattr(rm, "CODEC", {**rm.CODEC, "decoder_config": {
        **rm.CODEC["decoder_config"], "codebook_dim": 8, "hidden_size": 16, "intermediate_size": 32, "head_dim": 8,
        "latent_dim": 16, "decoder_dim": 32, "num_attention_heads": 2, "num_key_value_heads": 2,
        "num_hidden_layers": 1}})
    return rm


def test_random_kind_through_the_cli_alone_and_batched(tiny_random, tmp_path, capsys):
    out = _bench(capsys, "--random", "qwen3tts-0.6b", "--workdir", str(tmp_path), "--concurrency", "1,2")
    assert out["model"] == "qwen3tts custom_voice 0b6 (qwen3tts-0.6b, random weights; fp32)"
    assert out["tokens"] == 3 and out["audio_seconds"] == pytest.approx(3 * FRAME_SECONDS)
    assert out["batch_width"] == 2 and [r["concurrency"] for r in out["concurrency"]] == [1, 2]
    assert all(r["audio_seconds_per_s"] > 0 for r in out["concurrency"])
    assert json.loads((tmp_path / "qwen3tts-0.6b" / "config.json").read_text())["tts_model_size"] == "0b6"


def test_the_kinds_are_offered_and_an_unknown_one_refused(tmp_path):
    from mizuoto_qwen3tts.engine import Qwen3TTSEngine
    from mizuoto_qwen3tts.random_model import random_parts

    assert Qwen3TTSEngine.offers_bench() and "qwen3tts" in Qwen3TTSEngine.bench_random
    with pytest.raises(ValueError, match="qwen3tts-0.6b"):
        random_parts("qwen3tts-7b", tmp_path)


@pytest.mark.parametrize("size, billions", [("1.7b", 1.92), ("0.6b", 0.90)])
def test_released_sizes_built_on_the_meta_device(size, billions):
    """The full-size modules' parameter counts (no memory taken): talker, its text table and projection, and the
    code predictor; about 1.9B and 0.9B, the released model.safetensors' sizes."""
    from mizuoto_qwen3tts.code_predictor import CodePredictor
    from mizuoto_qwen3tts.random_model import model_config
    from mizuoto_qwen3tts.talker import Talker, qwen3_config, talker_config

    config = model_config(size)
    t = config["talker_config"]
    with torch.device("meta"):
        modules = [Talker(talker_config(config), t["text_vocab_size"], t["text_hidden_size"]),
                   CodePredictor(qwen3_config(t["code_predictor_config"], "", "code predictor"), t["hidden_size"], 16)]
    count = sum(p.numel() for m in modules for p in m.parameters())
    assert count / 1e9 == pytest.approx(billions, abs=0.01)
    assert (t["num_hidden_layers"], t["num_key_value_heads"], t["head_dim"], t["vocab_size"]) == (28, 8, 128, 3072)


def test_the_stand_in_tokenizer_keeps_the_chat_layout():
    from mizuoto_qwen3tts.prompt import ROLE_IDS, UNSPOKEN_TAIL
    from mizuoto_qwen3tts.random_model import TEXT_IDS, WordText

    ids = WordText().speech("Mizuoto measures, how fast.")[0].tolist()
    assert ids[:ROLE_IDS] == [TEXT_IDS["im_start"], 77091, 198]
    assert ids[-UNSPOKEN_TAIL:] == [TEXT_IDS["im_end"], 198, TEXT_IDS["im_start"], 77091, 198]
    assert len(ids) - ROLE_IDS - UNSPOKEN_TAIL == 6  # "Mizuoto", " measures", ",", " how", " fast", "."
    assert all(0 <= i < 151936 for i in ids)


def test_ban_stop_gives_exactly_max_new_tokens(monkeypatch):
    """With ban_stop the talker never draws its stop code: max_new_tokens tokens, one frame fewer. The talker's head
    is tilted towards the stop code here, so without the ban it stops as soon as upstream's minimum of new tokens
    allows, whatever the tree's weights."""
    from mizuoto_qwen3tts.generate import MIN_NEW_TOKENS, SamplingOptions
    from mizuoto_qwen3tts.layout import read_layout
    from mizuoto_qwen3tts.parts import load_parts

    layout = read_layout(ROOT / "models" / "custom_voice")
    parts = load_parts(layout)
    prefill = parts.prefill("Hello there.", language="auto", speaker=next(iter(layout.speakers)), instruct=None,
                            clone=None, non_streaming=True)
    eos, head = parts.loop.ids.codec_eos, parts.talker.head

    class StopTilted(torch.nn.Module):
        weight = head.weight
        out_features = head.out_features

        def forward(self, hidden: torch.Tensor) -> torch.Tensor:
            logits = head(hidden).clone()
            logits[..., eos] += 1e4
            return logits
    monkeypatch.setattr(parts.talker, "head", StopTilted())
    options = SamplingOptions(max_new_tokens=40)

    def run(ban: bool) -> tuple[int, list[int]]:
        tokens: list[int] = []
        frames = list(parts.loop.generate(prefill, options, torch.Generator().manual_seed(0),
                                          on_token=lambda t, h: tokens.append(t), ban_stop=ban))
        return len(frames), tokens
    frames, tokens = run(True)
    assert (frames, len(tokens)) == (39, 40) and eos not in tokens
    frames, tokens = run(False)
    assert (frames, len(tokens)) == (MIN_NEW_TOKENS, MIN_NEW_TOKENS + 1) and tokens[-1] == eos

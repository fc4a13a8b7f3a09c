"""Full-size Qwen3-TTS 12 Hz CustomVoice models with random weights, for `mizuoto bench --random qwen3tts`.

No released weights can be downloaded on the machines the benchmarks run on, so the modules are
built at the released sizes with PyTorch's default initialisation, straight from the sizes below
(no weight file is read). Timing does not depend on the values: the bench bans the talker's stop
code, so every run speaks exactly the frames asked for. The model is CustomVoice-like (the nine
preset speakers, so a request needs no reference clip); it has no speaker or codec encoder, as a
released CustomVoice model has none.

Where each size comes from:
- field names, the special ids and the codec decoder's defaults: upstream's config classes
  (qwen-tts 0.1.1, `core/models/configuration_qwen3_tts.py`, `core/tokenizer_12hz/
  configuration_qwen3_tts_tokenizer_v2.py`) and this plugin's fixtures (tests/fixtures/README.md:
  the ids, languages and speakers the released configs hold);
- the talker and code predictor of both sizes: the public description `docs/tts-model.md` of
  ivan-digital/qwen3-asr-swift (talker 28 layers, 16 heads, 8 KV heads of 128, hidden 1024 / 2048,
  text vocabulary 151936 at 2048, codec vocabulary 3072, interleaved M-RoPE [24, 20, 20], theta 1e6;
  code predictor 5 layers, hidden 1024, intermediate 3072, 16 heads, 8 KV heads of 128). Its
  intermediate size for the 1.7B talker (8192) is not used: two other public ports quote the
  released 1.7B config.json with 6144 (Qwen3-1.7B's), which also matches the released weight
  file's size (about 1.9B parameters); 0.6B's is 3072 in every source;
- the codec decoder: upstream's decoder config class (latent 1024, decoder_dim 1536, 8 layers,
  16 heads, sliding window 72, upsampling [2, 2] x [8, 5, 4, 3]) with the released file's
  transformer width (hidden 512, intermediate 1024, heads of 64, codebook dim 512; the public
  descriptions' "1024 -> 512 bottleneck").

The text tokenizer is a stand-in (`WordText`): the released Qwen2 BPE files are not here, so the
chat template's special and role tokens get their real ids and the text one id per word or
punctuation run (a hash inside the 151643 ordinary ids), about as many ids as the BPE gives English.
"""

from __future__ import annotations

import json
import re
import zlib
from pathlib import Path

import torch

from mizuoto_qwen3tts.code_predictor import CodePredictor
from mizuoto_qwen3tts.codec_decoder import CodecDecoder, decoder_config
from mizuoto_qwen3tts.ids import ModelIds
from mizuoto_qwen3tts.layout import TOKENIZER_12HZ, ModelLayout
from mizuoto_qwen3tts.parts import Parts
from mizuoto_qwen3tts.talker import Talker, qwen3_config, talker_config

# `mizuoto bench --random KIND` -> the released size it builds
KINDS = {"qwen3tts": "1.7b", "qwen3tts-1.7b": "1.7b", "qwen3tts-0.6b": "0.6b"}
MODEL_SIZE = {"1.7b": "1b7", "0.6b": "0b6"}  # config.json's tts_model_size
# the sizes (module-level, so a test can shrink them: tests/test_bench.py)
TALKER = {size: {"hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": 28,
                 "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 3072,
                 "text_vocab_size": 151936, "text_hidden_size": 2048, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
                 "rope_scaling": {"rope_type": "default", "interleaved": True, "mrope_section": [24, 20, 20]}}
          for size, (hidden, intermediate) in {"1.7b": (2048, 6144), "0.6b": (1024, 3072)}.items()}
PREDICTOR = {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 5, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 2048, "rms_norm_eps": 1e-6,
             "rope_theta": 1000000}
GROUPS = 16
# the released configs' ids (tests/fixtures/README.md lists the same; upstream's class defaults differ)
CODEC_IDS = {"codec_pad_id": 2148, "codec_bos_id": 2149, "codec_eos_token_id": 2150, "codec_think_id": 2154,
             "codec_nothink_id": 2155, "codec_think_bos_id": 2156, "codec_think_eos_id": 2157}
LANGUAGES = {"chinese": 2055, "english": 2050, "german": 2053, "italian": 2070, "portuguese": 2071, "spanish": 2054,
             "japanese": 2058, "korean": 2064, "french": 2061, "russian": 2069, "beijing_dialect": 2074,
             "sichuan_dialect": 2062}
SPEAKERS = {"serena": 3066, "vivian": 3065, "uncle_fu": 3010, "ryan": 3061, "aiden": 2861, "ono_anna": 2873,
            "sohee": 2864, "eric": 2875, "dylan": 2878}
DIALECTS = {"eric": "sichuan_dialect", "dylan": "beijing_dialect"}
TEXT_IDS = {"im_start": 151644, "im_end": 151645, "tts_pad": 151671, "tts_bos": 151672, "tts_eos": 151673}
ORDINARY_TEXT_IDS = 151643  # Qwen2's ordinary (non-special) ids: 0..151642
ROLE_IDS = {"assistant": 77091, "user": 872, "\n": 198}  # Qwen2 BPE's single tokens for the chat template
GENERATION = {"do_sample": True, "top_k": 50, "top_p": 1.0, "temperature": 0.9, "repetition_penalty": 1.05,
              "subtalker_dosample": True, "subtalker_top_k": 50, "subtalker_top_p": 1.0,
              "subtalker_temperature": 0.9, "max_new_tokens": 8192}
CODEC = {"decode_upsample_rate": 1920, "output_sample_rate": 24000, "input_sample_rate": 24000,
         "encode_downsample_rate": 1920, "encoder_valid_num_quantizers": 16,
         "decoder_config": {"codebook_size": 2048, "codebook_dim": 512, "hidden_size": 512, "intermediate_size": 1024,
                            "head_dim": 64, "latent_dim": 1024, "decoder_dim": 1536, "num_attention_heads": 16,
                            "num_key_value_heads": 16, "num_hidden_layers": 8, "sliding_window": 72,
                            "num_quantizers": 16, "rope_theta": 10000, "rms_norm_eps": 1e-5,
                            "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2]}}


def model_config(size: str) -> dict:
    """config.json of a released CustomVoice model of `size` ("1.7b" or "0.6b")."""
    predictor = {**PREDICTOR, "num_code_groups": GROUPS}
    talker = {**TALKER[size], "num_code_groups": GROUPS, "code_predictor_config": predictor,
              "codec_language_id": LANGUAGES, "spk_id": SPEAKERS,
              "spk_is_dialect": {k: DIALECTS.get(k, False) for k in SPEAKERS}, **CODEC_IDS}
    return {"model_type": "qwen3_tts", "tokenizer_type": TOKENIZER_12HZ, "tts_model_type": "custom_voice",
            "tts_model_size": MODEL_SIZE[size], "im_start_token_id": TEXT_IDS["im_start"],
            "im_end_token_id": TEXT_IDS["im_end"], "tts_pad_token_id": TEXT_IDS["tts_pad"],
            "tts_bos_token_id": TEXT_IDS["tts_bos"], "tts_eos_token_id": TEXT_IDS["tts_eos"], "talker_config": talker}


class WordText:
    """A stand-in for the Qwen2 tokenizer (`prompt.Prompts`' calls): the chat template's tokens by their real ids,
    the text one id per word or punctuation run."""

    PIECES = re.compile(r" ?\w+| ?[^\w\s]+|\s+")

    def _text(self, text: str) -> list[int]:
        return [zlib.crc32(p.encode("utf-8")) % ORDINARY_TEXT_IDS for p in self.PIECES.findall(text)]

    def _turn(self, role: str, text: str, then_assistant: bool) -> torch.Tensor:
        nl = ROLE_IDS["\n"]
        ids = [TEXT_IDS["im_start"], ROLE_IDS[role], nl, *self._text(text), TEXT_IDS["im_end"], nl]
        if then_assistant:
            ids += [TEXT_IDS["im_start"], ROLE_IDS["assistant"], nl]
        return torch.tensor([ids], dtype=torch.int64)

    def speech(self, text: str) -> torch.Tensor:
        """Ids of the text to speak in its chat turn (`prompt.speech_prompt`'s layout)."""
        return self._turn("assistant", text, True)

    def reference(self, ref_text: str) -> torch.Tensor:
        """Ids of a reference transcript in its chat turn."""
        return self._turn("assistant", ref_text, False)

    def instruction(self, instruct: str) -> torch.Tensor:
        """Ids of an instruction in the user's turn."""
        return self._turn("user", instruct, False)


def write_configs(folder: Path, size: str) -> ModelLayout:
    """The JSON files of a random model of `size` in `folder` (no weights, no tokenizer) and its layout."""
    folder = Path(folder)
    (folder / "speech_tokenizer").mkdir(parents=True, exist_ok=True)
    config = model_config(size)
    for name, data in (("config.json", config), ("generation_config.json", GENERATION),
                       ("speech_tokenizer/config.json", CODEC)):
        (folder / name).write_text(json.dumps(data, indent=2), encoding="utf-8")  # the codec's is read for memory
    ids = ModelIds.from_config(config, str(folder / "config.json"))
    return ModelLayout(folder, config, dict(GENERATION), "custom_voice", config["tts_model_size"],
                       config["talker_config"]["hidden_size"], ids.groups, ids,
                       {name: ids.dialects.get(name) for name in ids.speakers}, tuple(ids.supported_languages))


def random_parts(kind: str, folder: Path, seed: int = 0) -> Parts:
    """The parts of a full-size random CustomVoice model of `kind` (KINDS), its configs written in `folder`."""
    if kind not in KINDS:
        raise ValueError(f"unknown random Qwen3-TTS kind {kind!r}; known: {', '.join(KINDS)}")
    layout = write_configs(folder, KINDS[kind])
    config, where = layout.config, str(layout.model_dir / "config.json")
    talker_cfg = config["talker_config"]
    torch.manual_seed(seed)
    with torch.no_grad():
        talker = Talker(talker_config(config, where), talker_cfg["text_vocab_size"],
                        talker_cfg["text_hidden_size"]).eval()
        predictor = CodePredictor(qwen3_config(talker_cfg["code_predictor_config"], where, "code predictor"),
                                  talker_cfg["hidden_size"], GROUPS).eval()
        codec = CodecDecoder(decoder_config(CODEC, where), CODEC["decode_upsample_rate"],
                             CODEC["output_sample_rate"]).eval()
    return Parts(layout, WordText(), talker, predictor, codec)

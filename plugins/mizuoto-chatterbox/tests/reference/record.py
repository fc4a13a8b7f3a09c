"""Reference recorder: upstream chatterbox-tts 0.1.7 on the CPU with random, size-reduced weights.

Runs in the reference environment only (see README.md next to this file), never in the
project's own:

    /work/cbref/bin/python plugins/mizuoto-chatterbox/tests/reference/record.py build
    /work/cbref/bin/python plugins/mizuoto-chatterbox/tests/reference/record.py record [CASE...]
    /work/cbref/bin/python plugins/mizuoto-chatterbox/tests/reference/record.py verify

`build` writes the model dirs under tests/fixtures/models/ (upstream's file layout, random
weights from upstream's own modules at reduced sizes), `record` runs every case (or the named
ones) through `ChatterboxTTS` / `ChatterboxTurboTTS` (`from_local(dir, device="cpu")` then
`generate(...)`) and writes tests/fixtures/cases/<case>/{case.json,record.safetensors},
`verify` records every case again into a temporary tree and checks each tensor is
`torch.equal` to the committed one, and reruns each case with no observer installed to check
its output equals the recorded one.

Everything that is patched, and why, is listed in README.md; in short: a torchaudio stand-in
(`_torchaudio_stub.py`), reduced sizes given to upstream's constructors (`REDUCED`), and
observers wrapped around upstream calls that pass arguments and results through untouched.
The process re-executes itself once with a tiny LD_PRELOAD library that makes MKL take its
Intel code paths (the project's test suite runs the same way, see mizuoto/testing/mkl_intel.py),
so FFT/GEMM rounding matches the project's tests on AMD CPUs too.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
FIXTURES = HERE.parent / "fixtures"
MODELS = FIXTURES / "models"
CASES = FIXTURES / "cases"
UPSTREAM = "chatterbox-tts==0.1.7"
THREADS = 2

# --------------------------------------------------------------------------- MKL Intel path

_SHIM_ENV = "MIZUOTO_CB_MKL_SHIM"


def _reexec_with_mkl_shim() -> None:
    """Re-run this process with MKL forced onto its Intel kernels (as the project's tests are)."""
    if os.environ.get(_SHIM_ENV):
        return
    folder = Path(tempfile.gettempdir()) / "mizuoto-cb-mkl-shim"
    lib = folder / "libmkl_intel_shim.so"
    if not lib.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        src = folder / "shim.c"
        src.write_text("int mkl_serv_intel_cpu_true(void) { return 1; }\n")
        cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
        if cc is None:
            sys.exit("record.py needs a C compiler for the MKL Intel-path shim (see README.md)")
        tmp = folder / f".shim.{os.getpid()}.so"
        subprocess.run([cc, "-shared", "-fPIC", "-o", str(tmp), str(src)], check=True)
        os.replace(tmp, lib)
    env = dict(os.environ)
    env[_SHIM_ENV] = "1"
    env["LD_PRELOAD"] = f"{lib}:{env['LD_PRELOAD']}" if env.get("LD_PRELOAD") else str(lib)
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


# --------------------------------------------------------------------------- reduced sizes

# Every size that differs from upstream's released models. Upstream's constructors take most
# of these as arguments but S3Gen / T3 build their submodules with literals, so the recorder
# replaces those constructors' names (in the module that calls them) with wrappers that pass
# these values instead; nothing else about the modules changes. Written into each model dir
# as reduced_config.json (from_local ignores the extra file).
REDUCED = {
    "t3_llama": {  # LLAMA_CONFIGS["Llama_520M"] entries replaced (English T3)
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
    },
    "t3_perceiver": {  # T3CondEnc builds Perceiver() with 1024-wide literals
        "pre_attention_query_token": 32, "pre_attention_query_size": 32, "embedding_dim": 32, "num_attn_heads": 4,
    },
    "t3_gpt2": {  # LLAMA_CONFIGS["GPT2_medium"] entries replaced (Turbo T3)
        "n_embd": 32, "hidden_size": 32, "n_head": 2, "n_layer": 2, "n_positions": 2048, "n_ctx": 2048,
        "vocab_size": 8,  # GPT2Model.wte: loaded, then deleted by from_local (T3 embeds text itself)
    },
    # ChatterboxTurboTTS.from_local builds T3Config(text_tokens_dict_size=50276) (GPT-2's vocabulary
    # plus tags); the tiny tokenizer here has fewer than 320 ids, so the text tables are cut to 320
    "t3_turbo_text_tokens_dict_size": 320,
    "voice_encoder": {"ve_hidden_size": 48},  # VoiceEncConfig class attribute (speaker_embed_size stays 256)
    # S3TokenizerV2's default ModelConfig; its rotary table is 64 wide (a literal), so 64 per head
    "s3_tokenizer": {"n_audio_state": 64, "n_audio_head": 1, "n_audio_layer": 1},
    "campplus": {"growth_rate": 4, "bn_size": 2, "init_channels": 16},  # embedding_size stays 192
    "flow": {"input_size": 32},  # CausalMaskedDiffWithXvec
    "flow_encoder": {  # UpsampleConformerEncoder (+ its literal PreLookaheadLayer / Upsample1D widths)
        "input_size": 32, "output_size": 32, "attention_heads": 2, "linear_units": 64, "num_blocks": 2,
    },
    "flow_estimator": {  # ConditionalDecoder
        "channels": [32], "attention_head_dim": 16, "n_blocks": 1, "num_mid_blocks": 1, "num_heads": 2,
    },
    "hift": {"base_channels": 32},  # HiFTGenerator (rates, kernels, istft params unchanged)
    "f0_predictor": {"cond_channels": 32},  # ConvRNNF0Predictor
}

# How the random weights are made (after upstream's own initialisation, seeded per model).
INIT = {
    "constant_params_noise": 0.1,  # params left constant by init (norm scales, zero biases, snake alphas) get N(0, 0.1) added
    "batchnorm_running_mean_std": 0.1, "batchnorm_running_var_range": [0.5, 1.5],
    # English T3 stop tilt: channel 0 of every speech-token embedding is set to `emb0`, channel 0
    # of the speech position embedding to `pos0 + pos_slope * position`, and the speech head's
    # channel-0 column is zeroed except the stop token's, set to `stop_weight`. The stop logit
    # thus grows with the position while other logits stay random, so decodes end after tens of
    # tokens (upstream's English generate has max_new_tokens=1000 fixed). speech_head rows are
    # redrawn N(0, head_std) so min_p / top_p have peaked distributions to cut.
    "t3_en": {"emb0": 0.0, "pos0": -2.0, "pos_slope": 0.06, "stop_weight": 2.5, "head_std": 0.3},
    # Turbo (GPT-2, absolute positions inside the transformer, cond prompt first): same idea on
    # wpe channel 0, counted from `pos_start`; the speech head's bias is zero except stop's.
    "t3_turbo": {"emb0": 0.0, "pos_start": 180, "pos0": -2.5, "pos_slope": 0.06, "stop_weight": 2.5,
                 "head_std": 0.5, "stop_bias": 0.0},
    # HiFT's conv_post scaled so random magnitudes stay below upstream's exp clamp most of the time
    "hift_conv_post_scale": 0.3,
}

BUILD_SEEDS = {"en": 1234, "turbo": 4321}


def _wrap_ctor(module, name: str, overrides: dict) -> None:
    orig = getattr(module, name)
    if getattr(orig, "_mizuoto_reduced", False):
        return

    def ctor(*args, **kwargs):
        kwargs.update(overrides)
        return orig(*args, **kwargs)

    ctor._mizuoto_reduced = True
    ctor.__wrapped__ = orig
    setattr(module, name, ctor)


def patch_upstream() -> None:
    """Install the torchaudio stand-in and the reduced sizes; import upstream."""
    sys.path.insert(0, str(HERE))
    import _torchaudio_stub

    _torchaudio_stub.install()

    import chatterbox.models.s3gen.s3gen as s3gen_mod
    import chatterbox.models.s3gen.transformer.upsample_encoder as up_mod
    import chatterbox.models.t3.llama_configs as llama_configs
    import chatterbox.models.t3.modules.cond_enc as cond_enc
    import chatterbox.models.voice_encoder.voice_encoder as ve_mod
    import chatterbox.tts_turbo as tts_turbo
    import s3tokenizer.model_v2 as s3tok_v2

    llama_configs.LLAMA_CONFIGS["Llama_520M"].update(REDUCED["t3_llama"])
    llama_configs.LLAMA_CONFIGS["GPT2_medium"].update(REDUCED["t3_gpt2"])
    _wrap_ctor(cond_enc, "Perceiver", REDUCED["t3_perceiver"])
    _wrap_ctor(tts_turbo, "T3Config", {"text_tokens_dict_size": REDUCED["t3_turbo_text_tokens_dict_size"]})
    for k, v in REDUCED["voice_encoder"].items():
        setattr(ve_mod.VoiceEncConfig, k, v)
    # S3TokenizerV2(name, config=ModelConfig()): one default instance, shared; set its sizes
    default_cfg = s3tok_v2.S3TokenizerV2.__init__.__defaults__[0]
    for k, v in REDUCED["s3_tokenizer"].items():
        setattr(default_cfg, k, v)
    width = REDUCED["flow_encoder"]["output_size"]
    _wrap_ctor(up_mod, "PreLookaheadLayer", {"channels": width})
    _wrap_ctor(up_mod, "Upsample1D", {"channels": width, "out_channels": width})
    _wrap_ctor(s3gen_mod, "UpsampleConformerEncoder", REDUCED["flow_encoder"])
    _wrap_ctor(s3gen_mod, "ConditionalDecoder", REDUCED["flow_estimator"])
    _wrap_ctor(s3gen_mod, "CausalMaskedDiffWithXvec", REDUCED["flow"])
    _wrap_ctor(s3gen_mod, "HiFTGenerator", REDUCED["hift"])
    _wrap_ctor(s3gen_mod, "ConvRNNF0Predictor", REDUCED["f0_predictor"])
    _wrap_ctor(s3gen_mod, "CAMPPlus", REDUCED["campplus"])


# --------------------------------------------------------------------------- model building


def _randomize(module, gen) -> None:
    import torch

    noise = INIT["constant_params_noise"]
    with torch.no_grad():
        for p in module.parameters():
            if p.is_floating_point() and p.numel() > 1 and bool((p == p.reshape(-1)[0]).all()):
                p.add_(torch.randn(p.shape, generator=gen) * noise)
        for m in module.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=gen) * INIT["batchnorm_running_mean_std"])
                lo, hi = INIT["batchnorm_running_var_range"]
                m.running_var.copy_(lo + (hi - lo) * torch.rand(m.running_var.shape, generator=gen))


def _tilt_t3(t3, cfg: dict, gen, turbo: bool) -> None:
    import torch

    stop = t3.hp.stop_speech_token
    with torch.no_grad():
        t3.speech_emb.weight[:, 0] = cfg["emb0"]
        if turbo:
            pos = t3.tfmr.wpe.weight
            idx = torch.arange(pos.shape[0], dtype=torch.float32) - cfg["pos_start"]
        else:
            pos = t3.speech_pos_emb.emb.weight
            idx = torch.arange(pos.shape[0], dtype=torch.float32)
        pos[:, 0] = cfg["pos0"] + cfg["pos_slope"] * idx
        head = t3.speech_head.weight
        head.copy_(torch.randn(head.shape, generator=gen) * cfg["head_std"])
        head[:, 0] = 0.0
        head[stop, 0] = cfg["stop_weight"]
        if t3.speech_head.bias is not None:
            t3.speech_head.bias.zero_()
            t3.speech_head.bias[stop] = cfg["stop_bias"]


def _turbo_hp():
    """The T3Config ChatterboxTurboTTS.from_local builds (upstream's values)."""
    from chatterbox.tts_turbo import T3Config  # the (wrapped) name from_local calls

    hp = T3Config(text_tokens_dict_size=50276)
    hp.llama_config_name = "GPT2_medium"
    hp.speech_tokens_dict_size = 6563
    hp.input_pos_emb = None
    hp.speech_cond_prompt_len = 375
    hp.use_perceiver_resampler = False
    hp.emotion_adv = False
    return hp


def _save(module, path: Path) -> None:
    from safetensors.torch import save_file

    state = {k: v.detach().contiguous().clone() for k, v in module.state_dict().items()}
    save_file(state, str(path))


def _en_tokenizer(path: Path) -> None:
    """A small grapheme BPE in the HF tokenizers format upstream's EnTokenizer reads."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["[STOP]", "[UNK]", "[SPACE]", "[PAD]", "[SEP]", "[CLS]", "[MASK]"]
    vocab = {t: i for i, t in enumerate(specials)}
    chars = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'\"-()")
    for ch in chars:
        vocab[ch] = len(vocab)
    merges = [("t", "h"), ("th", "e"), ("i", "n"), ("e", "r"), ("a", "n"), ("o", "n"), ("r", "e"),
              ("in", "g"), ("e", "d"), ("o", "u"), ("T", "h"), ("Th", "e"), ("a", "t"), ("e", "s")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    assert len(vocab) < 255
    for i in range(len(vocab), 255):  # no holes below [START]: placeholders no merge produces
        vocab[f"<unused{i}>"] = i
    vocab["[START]"] = 255  # T3Config.start_text_token; stop_text_token is 0 = [STOP]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["[START]", *specials])
    tok.save(str(path))


TURBO_TAGS = ["[laugh]", "[chuckle]", "[sigh]", "[gasp]", "[cough]", "[clear throat]", "[sniff]", "[groan]", "[shush]"]


def _turbo_tokenizer(folder: Path) -> None:
    """A tiny GPT-2 style byte-level BPE (vocab.json, merges.txt, tokenizer.json, configs) with tags."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()  # the 256 byte symbols GPT-2 uses
    byte_order = sorted(alphabet, key=lambda c: ord(c))
    vocab = {c: i for i, c in enumerate(byte_order)}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("e", "r"), ("a", "n"), ("o", "n"), ("Ġ", "a"),
              ("r", "e"), ("in", "g"), ("e", "d"), ("o", "u"), ("Ġ", "s"), ("Ġ", "w"), ("a", "t"), ("e", "n"),
              ("Ġ", "c"), ("i", "s"), ("o", "r"), ("Ġ", "b"), ("l", "l"), ("Ġ", "f"), ("Ġ", "o"), ("Ġ", "h")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens(["<|endoftext|>"])
    tok.add_tokens(TURBO_TAGS)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False, indent=0) + "\n", encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    added = {t: tok.token_to_id(t) for t in TURBO_TAGS}
    (folder / "added_tokens.json").write_text(json.dumps(added, indent=1) + "\n", encoding="utf-8")
    (folder / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}, indent=1) + "\n")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False, "model_max_length": 1024,
        "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
    }, indent=1) + "\n")


PRESET_CLIPS = {"en": "clip16k_3p7s.wav", "turbo": "clip16k_6p5s.wav"}


def build(names: list[str]) -> None:
    import torch

    from chatterbox.models.s3gen import S3Gen
    from chatterbox.models.t3 import T3
    from chatterbox.models.voice_encoder import VoiceEncoder
    from chatterbox.tts import ChatterboxTTS
    from chatterbox.tts_turbo import ChatterboxTurboTTS

    torch.set_num_threads(THREADS)
    for name in names:
        out = MODELS / name
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        turbo = name == "turbo"
        seed = BUILD_SEEDS[name]
        gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        ve = VoiceEncoder().eval()
        _randomize(ve, gen)
        _save(ve, out / "ve.safetensors")

        torch.manual_seed(seed + 1)
        t3 = T3(_turbo_hp() if turbo else None).eval()
        _randomize(t3, gen)
        _tilt_t3(t3, INIT["t3_turbo" if turbo else "t3_en"], gen, turbo)
        _save(t3, out / ("t3_turbo_v1.safetensors" if turbo else "t3_cfg.safetensors"))

        torch.manual_seed(seed + 2)
        s3gen = S3Gen(meanflow=turbo).eval()
        _randomize(s3gen, gen)
        with torch.no_grad():
            conv_post = s3gen.mel2wav.conv_post
            for p in conv_post.parameters():
                p.mul_(INIT["hift_conv_post_scale"])
        _save(s3gen, out / ("s3gen_meanflow.safetensors" if turbo else "s3gen.safetensors"))

        if turbo:
            _turbo_tokenizer(out)
        else:
            _en_tokenizer(out / "tokenizer.json")

        # the preset voice: upstream's own prepare_conditionals on a reference clip, saved by Conditionals.save
        cls = ChatterboxTurboTTS if turbo else ChatterboxTTS
        model = cls.from_local(out, device="cpu")
        clip = PRESET_CLIPS[name]
        model.prepare_conditionals(str(_clip_path(clip)), exaggeration=0.5 if not turbo else 0.0)
        model.conds.save(out / "conds.pt")
        info = {
            "upstream": UPSTREAM, "class": cls.__name__, "build_seed": seed, "reduced": REDUCED,
            "init": INIT, "preset_voice_clip": clip,
            "preset_voice": "prepare_conditionals(clip, exaggeration=%s) then Conditionals.save" % (0.0 if turbo else 0.5),
            "files": sorted(p.name for p in out.iterdir()),
        }
        (out / "reduced_config.json").write_text(json.dumps(info, indent=1) + "\n")
        print(f"built {out}: {sum(p.stat().st_size for p in out.iterdir()) / 1e6:.2f} MB")


# --------------------------------------------------------------------------- cases

CLIP_SOURCES = [Path("/work/shared/fixtures/full/audio"), Path("/work/shared/fixtures/frontend/audio")]
CLIPS = FIXTURES / "clips"


# clips made here from a shared one: name -> (source, first N samples), PCM_16 samples unchanged
DERIVED_CLIPS = {"clip16k_6p5s.wav": ("clip16k_12s.wav", 104000)}  # Turbo wants > 5 s of reference


def _clip_path(name: str) -> Path:
    """Reference clips are copied once into fixtures/clips/ and always read from there."""
    dst = CLIPS / name
    if not dst.is_file() and name in DERIVED_CLIPS:
        import soundfile as sf

        src_name, n = DERIVED_CLIPS[name]
        data, sr = sf.read(str(_clip_path(src_name)), dtype="int16")
        CLIPS.mkdir(parents=True, exist_ok=True)
        sf.write(str(dst), data[:n], sr, subtype="PCM_16")
        (CLIPS / src_name).unlink()
    if not dst.is_file():
        for src in CLIP_SOURCES:
            if (src / name).is_file():
                CLIPS.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src / name, dst)
                break
        else:
            raise FileNotFoundError(name)
    return dst


EN_DEFAULTS = dict(repetition_penalty=1.2, min_p=0.05, top_p=1.0, audio_prompt_path=None, exaggeration=0.5,
                   cfg_weight=0.5, temperature=0.8)
TURBO_DEFAULTS = dict(repetition_penalty=1.2, min_p=0.0, top_p=0.95, audio_prompt_path=None, exaggeration=0.0,
                      cfg_weight=0.0, temperature=0.8, top_k=1000, norm_loudness=True)

LONG_TEXT = ("The old lighthouse keeper climbed the winding stairs every evening, counting each step out loud; "
             "at the top he lit the lamp, watched the ships pass in the dark, and wrote three lines in his "
             "logbook before the tea went cold.")

# Turbo texts of a given length: the stop tilt (INIT) makes the stop token likely at once past ~350
# positions (conditioning + text), so these shape Turbo's first draws without touching the model
FOX = "The quick brown fox jumps over the lazy dog and keeps on running far away."
TURBO_FIRST_STOP_TEXT = " ".join([FOX] * 2)  # 121 text ids: seed 31 draws the stop first, then speaks
TURBO_SILENT_TEXT = " ".join([FOX] * 3)  # 182 text ids: seed 0 draws the stop twice, T3 speaks nothing
TURBO_OVER_LIMIT_TEXT = " ".join([FOX] * 20)  # ~1200 text ids, past the tokenizer's model_max_length (1024)

# name: (model, clip or None, text, seed, generate overrides)
CASE_SPECS = {
    "en_preset_default": ("en", None, "Hello there, how are you today?", 0, {}),
    "en_preset_seed7": ("en", None, "Hello there, how are you today?", 7, {}),
    "en_preset_cfg0": ("en", None, "The weather is nice.", 3, {"cfg_weight": 0.0}),
    "en_preset_exag_high": ("en", None, "I can't believe we actually won!", 11, {"exaggeration": 1.5, "cfg_weight": 0.3}),
    "en_clone_24k": ("en", "clip24k_4p2s.wav", "Please leave a message after the tone.", 5, {}),
    "en_clone_22k_sampling": ("en", "clip22k_3p3s.wav", "Testing the sampling knobs, one two three.", 21,
                              {"temperature": 1.1, "min_p": 0.1, "top_p": 0.8, "repetition_penalty": 1.5,
                               "exaggeration": 0.25, "cfg_weight": 0.7}),
    "en_preset_long": ("en", None, LONG_TEXT, 2, {}),
    "turbo_preset_laugh": ("turbo", None, "Oh that is so funny [laugh] I really did not expect that.", 0, {}),
    "turbo_clone_6p5s": ("turbo", "clip16k_6p5s.wav", "Good morning, this is the turbo voice.", 9,
                        {"temperature": 0.9, "top_k": 200, "top_p": 0.9, "repetition_penalty": 1.3}),
    # Turbo ignores cfg_weight, min_p and exaggeration (it logs a warning): set here, they must change nothing
    "turbo_preset_sigh_seed3": ("turbo", None, "Well [sigh] I suppose we can try again tomorrow.", 3,
                                {"temperature": 0.7, "cfg_weight": 0.5, "min_p": 0.05, "exaggeration": 0.8}),
    # Turbo's punc_norm keeps "...", ";" and " - " (English's turns them into ", ")
    "turbo_preset_punctuation": ("turbo", None, "Wait... I think; no - let me check: it\u2019s fine\u2026 really",
                                 1, {}),
    "turbo_clone_no_loudness": ("turbo", "clip16k_6p5s.wav", "The reference keeps its own loudness here.", 17,
                                {"norm_loudness": False}),
    # upstream's first draw is outside its loop and never checked for the stop token: it draws on
    "turbo_preset_first_stop": ("turbo", None, TURBO_FIRST_STOP_TEXT, 31, {}),
    # every draw the stop token: S3Gen gets only the three silence tokens upstream appends
    "turbo_preset_silent": ("turbo", None, TURBO_SILENT_TEXT, 0, {}),
    # tokenized with truncation=True: cut to tokenizer_config.json's model_max_length
    "turbo_preset_over_limit": ("turbo", None, TURBO_OVER_LIMIT_TEXT, 4, {}),
}


# Cases where upstream itself raises: recorded as the error plus what was observed before it.
# ChatterboxTTS.generate(cfg_weight=0) keeps one text row but T3.inference always stacks two
# BOS embeddings (its CFG batch), so torch.cat([embeds, bos_embed], dim=1) fails in 0.1.7.
EXPECTED_ERRORS = {"en_preset_cfg0": "RuntimeError"}


class Observer:
    """Wraps upstream calls on one model instance; arguments and results pass through unchanged."""

    def __init__(self, model, turbo: bool):
        import numpy as np
        import torch

        self.rec: dict = {}
        self.sampled: list = []
        self._in_t3 = False
        rec, sampled = self.rec, self.sampled
        t3, s3gen = model.t3, model.s3gen
        t3_fn_name = "inference_turbo" if turbo else "inference"
        t3_fn = getattr(t3, t3_fn_name)
        orig_multinomial = torch.multinomial
        observer = self

        def multinomial(*args, **kwargs):
            out = orig_multinomial(*args, **kwargs)
            if observer._in_t3:
                sampled.append(out.detach().clone())
            return out

        def t3_inference(*args, **kwargs):
            cond = kwargs["t3_cond"]
            rec["text_tokens"] = kwargs["text_tokens"]
            rec["t3_cond_speaker_emb"] = cond.speaker_emb
            if cond.cond_prompt_speech_tokens is not None:
                rec["t3_cond_prompt_speech_tokens"] = cond.cond_prompt_speech_tokens
            if cond.emotion_adv is not None:
                rec["t3_cond_emotion_adv"] = cond.emotion_adv
            torch.multinomial = multinomial
            observer._in_t3 = True
            try:
                out = t3_fn(*args, **kwargs)
            finally:
                observer._in_t3 = False
                torch.multinomial = orig_multinomial
            rec["t3_output_tokens"] = out
            return out

        setattr(t3, t3_fn_name, t3_inference)

        def cond_enc_hook(module, args, output):  # forward hook: sees the output, returns nothing
            rec.setdefault("t3_cond_emb", output.detach().clone())

        t3.cond_enc.register_forward_hook(cond_enc_hook)

        s3_inference = s3gen.inference
        hift_inference = s3gen.hift_inference

        def s3gen_inference(*args, **kwargs):
            rec["s3gen_speech_tokens"] = kwargs["speech_tokens"]
            ref = kwargs["ref_dict"]
            for k in ("prompt_token", "prompt_token_len", "prompt_feat", "embedding"):
                if torch.is_tensor(ref.get(k)):
                    rec[f"s3gen_{k}"] = ref[k]
            wav, sources = s3_inference(*args, **kwargs)
            rec["s3gen_wav"] = wav
            return wav, sources

        def s3gen_hift(speech_feat, cache_source=None):
            rec["s3gen_mel"] = speech_feat
            out = hift_inference(speech_feat, cache_source)
            rec["hift_source"] = out[1]
            return out

        s3gen.inference = s3gen_inference
        s3gen.hift_inference = s3gen_hift

        apply_wm = model.watermarker.apply_watermark

        def apply_watermark(signal, sample_rate, **kw):
            rec["wav_pre_watermark"] = torch.from_numpy(np.array(signal, copy=True))
            out = apply_wm(signal, sample_rate=sample_rate, **kw)
            rec["wav_watermarked"] = torch.from_numpy(np.array(out, copy=True))
            return out

        model.watermarker.apply_watermark = apply_watermark

        # The clip front of a clone case: the 24 kHz wav S3Gen's reference embedding got (librosa's
        # load, soxr, Turbo's loudness gain, cut to 10 s), the 16 kHz resample (soxr) the S3
        # tokenizer and voice encoder got, and the voice encoder's mel (numpy STFT), so each later
        # step can be checked from its exact input.
        import chatterbox.models.voice_encoder.voice_encoder as ve_module
        import chatterbox.tts as tts_module
        import chatterbox.tts_turbo as turbo_module

        librosa = tts_module.librosa
        resample, ve_mel = librosa.resample, ve_module.melspectrogram
        self._restore = [(librosa, "resample", resample), (ve_module, "melspectrogram", ve_mel)]

        embed_ref = s3gen.embed_ref

        def observed_embed_ref(ref_wav, ref_sr, *args, **kwargs):
            rec.setdefault("s3gen_ref_wav", torch.as_tensor(np.array(ref_wav, dtype=np.float32, copy=True)))
            return embed_ref(ref_wav, ref_sr, *args, **kwargs)

        s3gen.embed_ref = observed_embed_ref

        def observed_resample(*args, **kwargs):
            out = resample(*args, **kwargs)
            if kwargs.get("target_sr") == 16000 and "clip_wav_16k" not in rec:
                rec["clip_wav_16k"] = torch.from_numpy(np.array(out, dtype=np.float32, copy=True))
            return out

        def observed_ve_mel(*args, **kwargs):
            mel = ve_mel(*args, **kwargs)
            rec.setdefault("ve_mel", torch.from_numpy(np.array(mel.T, dtype=np.float32, copy=True)))
            return mel

        librosa.resample, ve_module.melspectrogram = observed_resample, observed_ve_mel
        assert turbo_module.librosa is librosa

    def close(self) -> None:
        """Put back the module functions the observer wrapped."""
        for owner, name, fn in self._restore:
            setattr(owner, name, fn)

    def tensors(self, output) -> dict:
        import torch

        rec = {k: v.detach().cpu().clone().contiguous() for k, v in self.rec.items()}
        # left out of the record because they equal recorded tensors (checked here)
        assert torch.equal(rec.pop("s3gen_wav")[0], rec["wav_pre_watermark"])
        assert torch.equal(rec.pop("wav_watermarked"), output[0])
        rec.pop("hift_source")  # HiFT's sine source: large, and fixed by the seed and draw order
        rec["t3_sampled_tokens"] = torch.cat([s.reshape(-1) for s in self.sampled]).contiguous()
        rec["output"] = output.detach().cpu().clone().contiguous()
        return rec


KEY_DOC = {
    "text_tokens": "token ids T3 received: [START] + text + [STOP] (English, int32; two identical rows when cfg_weight > 0) / GPT-2 ids (Turbo, int64)",
    "t3_cond_speaker_emb": "voice-encoder speaker embedding in T3Cond [1, 256]",
    "t3_cond_prompt_speech_tokens": "S3 tokens of the reference's first 6 s (English) / 15 s (Turbo), T3's speech prompt [1, P]",
    "t3_cond_emotion_adv": "exaggeration as T3Cond.emotion_adv [1, 1, 1] (Turbo: stored, unused)",
    "t3_cond_emb": "T3CondEnc's output, the conditioning rows ahead of the text: speaker, prompt (en: 32 Perceiver rows; turbo: P token rows), en: emotion [1, C, hidden]",
    "t3_sampled_tokens": "every torch.multinomial draw during T3 decoding, in order, the stop token (6562) included when drawn [N]",
    "t3_output_tokens": "what t3.inference / inference_turbo returned [1, N] (Turbo strips a final stop)",
    "s3gen_speech_tokens": "tokens passed to S3Gen.inference (invalid >= 6561 dropped; Turbo: + 3x S3GEN_SIL 4299) [T]",
    "s3gen_prompt_token": "S3Gen prompt tokens of the reference [1, Tp]",
    "s3gen_prompt_token_len": "Tp as upstream holds it [1]",
    "s3gen_prompt_feat": "S3Gen prompt mel of the reference (24 kHz) [1, F, 80], F = 2*Tp or 2*Tp + 1",
    "s3gen_embedding": "CAM++ x-vector of the reference (16 kHz) [1, 192]",
    "s3gen_mel": "flow output past the prompt, HiFT's input [1, 80, M], M = 2*(Tp + T) - F",
    "wav_pre_watermark": "S3Gen.inference's wav (after its trim_fade), as handed to the Perth watermarker [480*M]",
    "output": "generate()'s return value = the watermarker's output [1, 480*M]",
    "s3gen_ref_wav": "clone only: the 24 kHz wav S3Gen.embed_ref got: librosa.load(clip, sr=24000) (soxr_hq when the clip is not 24 kHz), Turbo's loudness gain, cut to 10 s [S24]",
    "clip_wav_16k": "clone only: librosa.resample of that to 16 kHz (soxr_hq), the S3 tokenizer's and voice encoder's input [S16]",
    "ve_mel": "clone only: the voice encoder's mel of the trimmed 16 kHz clip (numpy STFT, power 2, 40 mels) [T, 40]",
}


def record_case(name: str, out_root: Path) -> dict:
    import numpy as np
    import torch
    from safetensors.torch import save_file

    from chatterbox.tts import ChatterboxTTS
    from chatterbox.tts_turbo import ChatterboxTurboTTS

    model_name, clip, text, seed, overrides = CASE_SPECS[name]
    turbo = model_name == "turbo"
    cls = ChatterboxTurboTTS if turbo else ChatterboxTTS
    kwargs = dict(TURBO_DEFAULTS if turbo else EN_DEFAULTS)
    kwargs.update(overrides)
    case_dir = out_root / name
    case_dir.mkdir(parents=True, exist_ok=True)
    if clip is not None:
        kwargs["audio_prompt_path"] = str(_clip_path(clip))

    torch.set_num_threads(THREADS)
    model = cls.from_local(MODELS / model_name, device="cpu")
    obs = Observer(model, turbo)
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    error = None
    try:
        output = model.generate(text, **kwargs)
    except Exception as exc:  # noqa: BLE001 - recorded, then checked against EXPECTED_ERRORS
        if type(exc).__name__ != EXPECTED_ERRORS.get(name):
            raise
        error = {"type": type(exc).__name__, "message": str(exc).splitlines()[0],
                 "where": "ChatterboxTTS.generate -> T3.inference: torch.cat([embeds, bos_embed], dim=1)"}
        tensors = {k: v.detach().cpu().clone().contiguous() for k, v in obs.rec.items()}
    else:
        assert name not in EXPECTED_ERRORS, f"{name}: upstream was expected to raise"
        tensors = obs.tensors(output)
    obs.close()
    for k, v in tensors.items():
        assert torch.isfinite(v.float()).all(), f"{name}: {k} not finite"
    save_file(tensors, str(case_dir / "record.safetensors"))

    case_kwargs = dict(kwargs)
    if clip is not None:
        case_kwargs["audio_prompt_path"] = f"clips/{clip}"
    meta = {
        "upstream": UPSTREAM,
        "class": cls.__name__,
        "model": model_name,
        "model_dir": f"models/{model_name}",
        "mode": "clone" if clip is not None else "preset",
        "reference_clip": None if clip is None else f"clips/{clip}",
        "preset_voice": f"models/{model_name}/conds.pt" if clip is None else None,
        "text": text,
        "generate_kwargs": case_kwargs,
        "seed": seed,
        "seeding": "torch.manual_seed(seed); random.seed(seed); numpy.random.seed(seed) right after from_local, before generate",
        "torch_threads": THREADS,
        "dtype": "float32",
        "device": "cpu",
        "tensors": {k: {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", ""), "what": KEY_DOC[k]}
                    for k, v in sorted(tensors.items())},
    }
    if error is not None:
        meta["expected_error"] = error
    else:
        meta["num_sampled_tokens"] = int(tensors["t3_sampled_tokens"].numel())
        meta["stopped"] = bool((tensors["t3_sampled_tokens"] == 6562).any())
        meta["output_seconds"] = round(tensors["output"].shape[-1] / 24000, 3)
    (case_dir / "case.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return meta


def record(names: list[str], out_root: Path) -> None:
    for name in names:
        meta = record_case(name, out_root)
        if "expected_error" in meta:
            print(f"{name}: upstream raised {meta['expected_error']['type']} as expected")
        else:
            print(f"{name}: {meta['num_sampled_tokens']} tokens sampled, stopped={meta['stopped']}, "
                  f"{meta['output_seconds']} s")


def _plain_output(name: str):
    """generate()'s output for a case with no observer installed (to show observing changes nothing)."""
    import numpy as np
    import torch

    from chatterbox.tts import ChatterboxTTS
    from chatterbox.tts_turbo import ChatterboxTurboTTS

    model_name, clip, text, seed, overrides = CASE_SPECS[name]
    turbo = model_name == "turbo"
    kwargs = dict(TURBO_DEFAULTS if turbo else EN_DEFAULTS)
    kwargs.update(overrides)
    if clip is not None:
        kwargs["audio_prompt_path"] = str(_clip_path(clip))
    torch.set_num_threads(THREADS)
    model = (ChatterboxTurboTTS if turbo else ChatterboxTTS).from_local(MODELS / model_name, device="cpu")
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    return model.generate(text, **kwargs)


def verify(names: list[str]) -> int:
    """Re-record into a temp tree and compare every tensor; also rerun without observers."""
    import torch
    from safetensors.torch import load_file

    bad = 0
    for name in names:
        if name in EXPECTED_ERRORS:
            continue
        same = torch.equal(_plain_output(name), load_file(str(CASES / name / "record.safetensors"))["output"])
        bad += not same
        print(f"{name}: output without observers {'equal' if same else 'DIFFERS'}")
    with tempfile.TemporaryDirectory() as tmp:
        record(names, Path(tmp))
        for name in names:
            a = load_file(str(CASES / name / "record.safetensors"))
            b = load_file(str(Path(tmp) / name / "record.safetensors"))
            same = a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
            bad += not same
            print(f"{name}: {'bit-identical' if same else 'DIFFERS'}")
    print("all bit-identical" if not bad else f"{bad} checks differ")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("command", choices=["build", "record", "verify", "all"])
    ap.add_argument("names", nargs="*", help="model names (build) or case names (record/verify); default all")
    args = ap.parse_args()
    _reexec_with_mkl_shim()
    patch_upstream()
    if args.command in ("build", "all"):
        build(args.names if args.command == "build" and args.names else ["en", "turbo"])
    if args.command in ("record", "all"):
        record(args.names if args.command == "record" and args.names else list(CASE_SPECS), CASES)
    if args.command == "verify":
        return verify(args.names or list(CASE_SPECS))
    return 0


if __name__ == "__main__":
    sys.exit(main())

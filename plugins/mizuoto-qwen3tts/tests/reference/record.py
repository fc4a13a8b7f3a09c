"""Reference recorder: upstream qwen-tts 0.1.1 (Qwen3-TTS 12 Hz) on the CPU with random, size-reduced weights.

Runs in the reference environment only (see README.md next to this file), never in the
project's own:

    /work/qwref/bin/python plugins/mizuoto-qwen3tts/tests/reference/record.py build
    /work/qwref/bin/python plugins/mizuoto-qwen3tts/tests/reference/record.py record [CASE...]
    /work/qwref/bin/python plugins/mizuoto-qwen3tts/tests/reference/record.py all
    /work/qwref/bin/python plugins/mizuoto-qwen3tts/tests/reference/record.py verify [CASE...]
    /work/qwref/bin/python plugins/mizuoto-qwen3tts/tests/reference/record.py record --cap avx2 [CASE...]
    /work/qwref/bin/python plugins/mizuoto-qwen3tts/tests/reference/record.py verify --cap avx2 [CASE...]
    /work/qwref/bin/python plugins/mizuoto-qwen3tts/tests/reference/record.py diff
    /work/qwref/bin/python plugins/mizuoto-qwen3tts/tests/reference/record.py all --variant alt --tree /tmp/qwen-alt
    /work/qwref/bin/python plugins/mizuoto-qwen3tts/tests/reference/record.py record --cap avx2 --variant alt --tree /tmp/qwen-alt

`build` writes the model dirs under tests/fixtures/models/ (upstream's released file layout,
configs from upstream's own config classes at reduced sizes, random seeded weights in upstream's
own modules, a small hand-made byte-level BPE text tokenizer) and the reference clips under
tests/fixtures/clips/. `record` runs every case of `CASES` (or the named ones) through upstream's
public wrapper (`Qwen3TTSModel.from_pretrained(dir, device_map="cpu", dtype=torch.float32)`, then
one `generate_voice_clone` / `generate_custom_voice` / `generate_voice_design` call) and writes
tests/fixtures/cases/<case>/{case.json,record.safetensors}. `all` is build + record. `verify`
reruns each case with no observer installed and checks its waveform equals the recorded one, then
records every case again into a temporary tree and checks each tensor is `torch.equal` (same dtype)
to the committed one.

CPU classes (`mizuoto.testing.cpu_recordings`, imported from this repository): `record` and `verify`
work on the recording of the class the run counts as. That is the tree's own `cases/` when the class
is one of `fixtures/cpu.json`'s `recorded_on`, else `fixtures/cpu/<class>/cases/<case>/` (case.json
then also names `cpu_class`, the machine's `cpu` and the `isa_caps` in force). `--cap avx2` /
`--cap avx512` runs as that narrower class on a wider CPU (`ISA_CAPS`: torch's own kernels, MKL and
oneDNN capped together). A class recording must keep every integer tensor and every case.json field
of the tree's own, and is stored only when some float tensor differs from it. `diff` prints, per
key, the largest differences between the tree's own recording and each class folder.

Other trees: `--tree DIR` writes / reads DIR instead of tests/fixtures/, and `--variant alt` records
there from a second recipe (`VARIANTS`: other sizes, 8 code groups, a 1024-code codebook, other ids,
seeds, clips, texts and a decode past the codec decoder's 72-frame window), for checking a port on a
tree of the same layout that is not the committed one (README.md, section 2b).

What is patched, and why, is listed in README.md; in short: empty placeholder modules for `sox`,
`onnxruntime` and `torchaudio` (imported at module level by the unused 25 Hz tokenizer only),
reduced sizes given to upstream's config classes (`REDUCED`), random weights (`INIT`), and observers
around upstream calls that pass arguments and results through untouched. Like the Chatterbox
recorder, the process re-executes itself once with a one-line LD_PRELOAD library that makes MKL take
its Intel code paths (the project's test suite runs the same way, mizuoto/testing/mkl_intel.py).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.machinery
import json
import os
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
FIXTURES = HERE.parent / "fixtures"
MODELS = FIXTURES / "models"
CLIPS = FIXTURES / "clips"
CASES = FIXTURES / "cases"
REPO = HERE.parents[3]  # the repository root: mizuoto.testing.cpu_recordings names the CPU classes
UPSTREAM = "qwen-tts==0.1.1"
THREADS = 2
FROM_PRETRAINED = {"device_map": "cpu", "dtype": "float32"}  # torch.float32; attn_implementation left to transformers

# --------------------------------------------------------------------------- MKL Intel path

_SHIM_ENV = "MIZUOTO_QWEN_MKL_SHIM"


def _reexec_with_mkl_shim(caps: dict[str, str] | None = None) -> None:
    """Re-run this process with MKL forced onto its Intel kernels (as the project's tests are).

    `caps`: environment variables the new process gets as well (an ISA cap, `ISA_CAPS`); they must be
    in place before torch, MKL and oneDNN are loaded, hence here.
    """
    caps = caps or {}
    if os.environ.get(_SHIM_ENV) and all(os.environ.get(k) == v for k, v in caps.items()):
        return
    folder = Path(tempfile.gettempdir()) / "mizuoto-qwen-mkl-shim"
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
    env.update(caps)
    if not env.get(_SHIM_ENV):
        env["LD_PRELOAD"] = f"{lib}:{env['LD_PRELOAD']}" if env.get("LD_PRELOAD") else str(lib)
    env[_SHIM_ENV] = "1"
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


# --------------------------------------------------------------------------- CPU classes

# `--cap <isa>`: run as that narrower class on a wider CPU. Each caps the three places where the
# kernels are chosen, to the same ISA: torch's own vectorised kernels (ATEN_CPU_CAPABILITY), MKL's
# sgemm / FFT dispatch (MKL_ENABLE_INSTRUCTIONS) and oneDNN's convolutions (ONEDNN_MAX_CPU_ISA).
# cpu_recordings._capped_isa reads the same variables, so the project's test suite run with them
# counts as the same class. "avx512" is AVX-512 without AMX (and without AVX10 / FP16 / BF16 /
# VNNI extensions: MKL's and oneDNN's plain AVX-512 paths); torch's capability has no wider level.
ISA_CAPS = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "MKL_ENABLE_INSTRUCTIONS": "AVX512",
               "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
}
CAP_VARS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA")
# case.json fields a class recording adds to the tree's own (everything else must be equal)
CLASS_FIELDS = ("cpu_class", "cpu", "isa_caps", "torch_cpu_capability")
MACHINE_FIELDS = ("cpu",)  # describe the machine, not the class: `verify` on another machine ignores them


def _cpu_recordings():
    """The project's CPU-class module (plain Python + torch; importable from the reference environment)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from mizuoto.testing import cpu_recordings

    return cpu_recordings


def _machine() -> str:
    """This CPU as a recording's `cpu` field names it: model name, then its avx512* / amx* flags."""
    cr = _cpu_recordings()
    try:
        fields = cr.read_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        fields = {}
    flags = [f for f in fields.get("flags", "").split() if cr._FLAG.fullmatch(f)]
    model = fields.get("model name", "unknown CPU")
    return f"{model} ({' '.join(flags)})" if flags else model


def class_target():
    """(class, its cases folder, whether that is the tree's own recording) for the class this run counts as."""
    cr = _cpu_recordings()
    cpu = cr.this_class()
    if cpu in cr.recorded_on(FIXTURES):
        return cpu, CASES, True
    for folder in sorted(p for p in (FIXTURES / cr.CPU_FOLDER).glob("*") if (p / "cases").is_dir()):
        metas = [json.loads(m.read_text(encoding="utf-8")) for m in folder.glob("cases/*/case.json")]
        if cr.folder_class(folder, metas) == cpu:
            return cpu, folder / "cases", False
    return cpu, FIXTURES / cr.CPU_FOLDER / cpu.name / "cases", False


def class_fields(cpu) -> dict:
    """What a class recording's case.json says about its CPU (`folder_class` reads `cpu_class`)."""
    import torch

    return {
        "cpu_class": cpu.name,
        "cpu": _machine(),
        "isa_caps": {k: os.environ[k] for k in CAP_VARS if os.environ.get(k)},
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


# --------------------------------------------------------------------------- importing upstream

# Imported at module level by qwen_tts/core/tokenizer_25hz/vq/speech_vq.py only (the 25 Hz
# tokenizer, which no 12 Hz model uses). None of them is installed (torchaudio has no wheel for
# torch 2.13); each is an empty module, so any use of it would fail loudly.
PLACEHOLDER_MODULES = ("sox", "onnxruntime", "torchaudio", "torchaudio.compliance", "torchaudio.compliance.kaldi")


def patch_upstream() -> None:
    """Offline hub, placeholder modules for the 25 Hz tokenizer's imports, then import qwen_tts."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # transformers decides once, at import, which optional packages exist: import it before the
    # placeholders appear, so it never takes them for a real torchaudio.
    import transformers  # noqa: F401
    import transformers.utils.import_utils  # noqa: F401

    for name in PLACEHOLDER_MODULES:
        if name in sys.modules:
            continue
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        module.__doc__ = "mizuoto reference recorder: empty placeholder (only qwen-tts' 25 Hz tokenizer imports it)"
        sys.modules[name] = module
    sys.modules["torchaudio"].compliance = sys.modules["torchaudio.compliance"]
    sys.modules["torchaudio.compliance"].kaldi = sys.modules["torchaudio.compliance.kaldi"]
    import qwen_tts  # noqa: F401


# --------------------------------------------------------------------------- reduced sizes

# Every size that differs from upstream's released 12 Hz models. The structural ids stay the
# released ones: talker vocabulary 3072 (codes 0..2047, control / language / speaker ids above),
# codebook 2048, 16 code groups, the codec control ids, language ids and preset speaker ids.
# Written into each model dir as reduced_config.json (upstream ignores the extra file).
REDUCED = {
    "talker": {
        "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
        # interleaved M-RoPE over 3 (equal) position streams; the sections sum to head_dim / 2
        "rope_scaling": {"rope_type": "default", "mrope_section": [4, 2, 2], "interleaved": True},
        "text_hidden_size": 24,  # != hidden_size: text_projection resizes 24 -> 16
        # text_vocab_size: the tiny tokenizer's length rounded up to 64 (set in tts_config)
    },
    "code_predictor": {  # hidden 8 != talker 16: small_to_mtp_projection is a Linear, as in 1.7B
        "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
    },
    "speaker_encoder": {  # ECAPA-TDNN; enc_dim must equal the talker hidden size, mel_dim stays 128
        "enc_dim": 16, "enc_channels": [16, 16, 16, 16, 48], "enc_attention_channels": 8,
        "enc_res2net_scale": 8, "enc_se_channels": 8,
    },
    "codec_encoder": {  # transformers' MimiConfig (the 12 Hz tokenizer keeps Mimi's encoder half)
        "hidden_size": 32, "num_filters": 4, "num_residual_layers": 1, "codebook_dim": 4,
        "vector_quantization_hidden_dimension": 4, "num_hidden_layers": 1, "intermediate_size": 64,
        "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16, "upsample_groups": 32,
    },
    "codec_decoder": {  # Qwen3TTSTokenizerV2DecoderConfig
        "hidden_size": 32, "latent_dim": 32, "intermediate_size": 64, "num_attention_heads": 2,
        "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 1, "codebook_dim": 8,
        "decoder_dim": 64,
    },
}

# Released values kept (written explicitly so the configs say them, not upstream's class defaults).
CODEC_IDS = {
    "codec_eos_token_id": 2150, "codec_think_id": 2154, "codec_nothink_id": 2155,
    "codec_think_bos_id": 2156, "codec_think_eos_id": 2157, "codec_pad_id": 2148, "codec_bos_id": 2149,
}
LANGUAGE_IDS = {
    "chinese": 2055, "english": 2050, "german": 2053, "italian": 2070, "portuguese": 2071,
    "spanish": 2054, "japanese": 2058, "korean": 2064, "french": 2061, "russian": 2069,
}
DIALECT_IDS = {"beijing_dialect": 2074, "sichuan_dialect": 2062}  # CustomVoice only
SPEAKER_IDS = {  # CustomVoice's nine preset speakers
    "serena": 3066, "vivian": 3065, "uncle_fu": 3010, "ryan": 3061, "aiden": 2861,
    "ono_anna": 2873, "sohee": 2864, "eric": 2875, "dylan": 2878,
}
SPEAKER_DIALECT = {"eric": "sichuan_dialect", "dylan": "beijing_dialect"}

# Upstream reads this file as a plain dict of defaults (Qwen3TTSModel._merge_generate_kwargs).
GENERATION_CONFIG = {
    "do_sample": True, "top_k": 50, "top_p": 1.0, "temperature": 0.9, "repetition_penalty": 1.05,
    "subtalker_dosample": True, "subtalker_top_k": 50, "subtalker_top_p": 1.0, "subtalker_temperature": 0.9,
    "max_new_tokens": 8192,
}

# How the random weights are made (documented in README.md; every float tensor of the state dict,
# visited in sorted name order, drawn from one torch.Generator seeded per model).
INIT = {
    "matrix": "N(0, 1) / sqrt(fan_in) for every tensor of 2+ dims (linear, conv, embedding)",
    "bias_std": 0.02,
    "norm_weight": "1 + N(0, 0.1) (RMSNorm / LayerNorm weights; upstream's models have no BatchNorm)",
    "snake_log_alpha_beta_std": 0.1,  # SnakeBeta's alpha / beta are logs (upstream inits them to 0)
    "layer_scale": "0.1 + N(0, 0.01)",
    # codebooks: upstream inits embedding_sum to zeros (every code the same vector); drawn N(0, 1),
    # and cluster_usage U(0.5, 2.0) so the division embedding_sum / cluster_usage is no identity
    "codebook_embedding_sum_std": 1.0, "codebook_cluster_usage_range": [0.5, 2.0],
    # the codec decoder's last conv (-> 1 channel) scaled so the waveform stays inside upstream's clamp(-1, 1)
    "codec_decoder_last_conv_scale": 0.01,
    # Stop tilt (talker): channel 0 of the talker's residual stream carries only the input
    # embedding's channel 0 (row 0 of every o_proj and down_proj is zero), which is zero for every
    # codec embedding and every text token except <tts_pad>: text_embedding[:, 0] is 0 except
    # pad's (1), and text_projection maps it to channel 0 alone (fc1 row 0 = [pad_gain, 0, ...], bias 0;
    # fc2 row 0 = [pad_out, 0, ...], bias 0). The codec head's channel-0 column is 0 except the
    # stop id's (stop_weight). So the stop logit rises only where tts_pad is added to the step's
    # input: after the text is consumed (streaming text) or throughout (non-streaming), as a
    # trained model stops after the text; decodes end after a few to tens of frames.
    "stop_tilt": {"pad_gain": 3.0, "pad_out": 2.0, "stop_weight": 1.6},
}
BUILD_SEEDS = {"codec": 1207, "base": 1234, "custom_voice": 4321}  # voice_design shares custom_voice's weights
NUM_CODE_GROUPS = 16  # code groups of the talker / code predictor = the codec's quantizers (released: 16)
ENCODER_QUANTIZERS = None  # the codec encoder's (Mimi's) quantizers when more than the valid NUM_CODE_GROUPS
CODEBOOK_SIZE = 2048  # codes a codebook holds (released), the code predictor's vocabulary
TALKER_VOCAB = 3072  # the talker's vocabulary (released): the codes, then 1024 control / language / speaker ids, which
# upstream suppresses ([vocab - 1024, vocab)) but for the stop code
STOP_WEIGHT: dict = {}  # model type -> the stop tilt's stop_weight where it is not INIT's (a variant's long decodes)
VARIANT = "main"  # the recipe (`--variant`, VARIANTS): "main" is the committed tree's


def _randomize(module, seed: int) -> None:
    """Every float tensor of `module`'s state dict redrawn (see INIT), from one seeded generator."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    state = module.state_dict(keep_vars=True)
    with torch.no_grad():
        for name in sorted(state):
            t = state[name]
            leaf = name.rsplit(".", 1)[-1]
            if not t.is_floating_point() or leaf == "initialized":  # Mimi's codebook flag stays upstream's
                continue
            r = torch.randn(t.shape, generator=gen)
            if leaf in ("embedding_sum", "embed_sum"):
                t.copy_(r * INIT["codebook_embedding_sum_std"])
            elif leaf == "cluster_usage":
                lo, hi = INIT["codebook_cluster_usage_range"]
                t.copy_(lo + (hi - lo) * torch.rand(t.shape, generator=gen))
            elif t.dim() >= 2:
                t.copy_(r / float(t[0].numel()) ** 0.5)
            elif leaf == "bias":
                t.copy_(r * INIT["bias_std"])
            elif leaf in ("alpha", "beta"):
                t.copy_(r * INIT["snake_log_alpha_beta_std"])
            elif leaf in ("scale", "gamma"):
                t.copy_(0.1 + 0.01 * r)
            else:  # norm weights (RMSNorm, LayerNorm)
                t.copy_(1.0 + 0.1 * r)


def _tilt_stop(model, tts_pad_id: int, stop_weight: float | None = None) -> None:
    """The stop tilt of INIT["stop_tilt"] on a Qwen3TTSForConditionalGeneration (`stop_weight`: STOP_WEIGHT's)."""
    import torch

    cfg = dict(INIT["stop_tilt"])
    if stop_weight is not None:
        cfg["stop_weight"] = stop_weight
    talker = model.talker
    stop = talker.config.codec_eos_token_id
    with torch.no_grad():
        for layer in talker.model.layers:
            layer.self_attn.o_proj.weight[0].zero_()
            layer.mlp.down_proj.weight[0].zero_()
        talker.model.codec_embedding.weight[:, 0] = 0.0
        for table in talker.code_predictor.model.codec_embedding:
            table.weight[:, 0] = 0.0
        text = talker.model.text_embedding.weight
        text[:, 0] = 0.0
        text[tts_pad_id, 0] = 1.0
        fc1, fc2 = talker.text_projection.linear_fc1, talker.text_projection.linear_fc2
        fc1.weight[0].zero_()
        fc1.weight[0, 0] = cfg["pad_gain"]
        fc1.bias[0] = 0.0
        fc2.weight[0].zero_()
        fc2.weight[0, 0] = cfg["pad_out"]
        fc2.bias[0] = 0.0
        head = talker.codec_head.weight
        head[:, 0] = 0.0
        head[stop, 0] = cfg["stop_weight"]


# --------------------------------------------------------------------------- text tokenizer

# A byte-level BPE in Qwen2's file format (vocab.json + merges.txt), read by upstream through
# AutoProcessor -> Qwen2TokenizerFast (converted from the two files, Qwen2's pre-tokenizer regex).
# Ids 0..255 are the 256 byte symbols, then merged pieces, then the special tokens in the released
# relative order (<|endoftext|>, <|im_start|>, <|im_end|>, ..., <tts_pad>, <tts_text_bos>, <tts_text_eod>).
# "assistant", "user" and "\n" must be single tokens (upstream slices the chat template by position).
MERGE_WORDS = [
    "assistant", "user", "Hello", "Ġworld", "Ġthe", "Ġvoice", "Ġspeak", "Ġcalm", "Ġwarm", "Ġslow",
    "Ġtest", "Ġis", "Ġa", "Ġof", "Ġand", "Ġto", "Ġin", "Ġthis", "Ġreference", "Ġclip", "The", "Please",
]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|audio_start|>", "<|audio_end|>",
                  "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>"]


def _byte_symbols() -> list[str]:
    """The printable stand-in for each byte 0..255 that byte-level BPE vocabularies use."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def _write_bpe(folder: Path) -> None:
    symbols = _byte_symbols()
    order = sorted(range(256), key=lambda b: ord(symbols[b]))  # vocab in symbol order, as GPT-2 / Qwen2 list it
    vocab = {symbols[b]: i for i, b in enumerate(order)}
    merges: list[str] = []
    for word in MERGE_WORDS:
        pieces = ["Ġ", *word[1:]] if word.startswith("Ġ") else list(word)
        cur = pieces[0]
        for ch in pieces[1:]:
            if f"{cur} {ch}" not in merges:
                merges.append(f"{cur} {ch}")
            cur += ch
            vocab.setdefault(cur, len(vocab))
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")


def _text_tokenizer(tmp: Path):
    from transformers import Qwen2Tokenizer

    _write_bpe(tmp)
    tok = Qwen2Tokenizer(
        vocab_file=str(tmp / "vocab.json"), merges_file=str(tmp / "merges.txt"),
        unk_token=None, bos_token=None, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False, model_max_length=131072,
    )
    tok.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    return tok


# --------------------------------------------------------------------------- configs


def tts_config(model_type: str, tok):
    """A Qwen3TTSConfig of `model_type` (base / custom_voice / voice_design) at the reduced sizes."""
    from qwen_tts.core.models import Qwen3TTSConfig

    ids = tok.convert_tokens_to_ids
    languages = dict(LANGUAGE_IDS, **(DIALECT_IDS if model_type == "custom_voice" else {}))
    talker = dict(REDUCED["talker"])
    talker.update(CODEC_IDS)
    talker.update(
        code_predictor_config=dict(REDUCED["code_predictor"], vocab_size=CODEBOOK_SIZE, num_code_groups=NUM_CODE_GROUPS,
                                   max_position_embeddings=65536, rope_theta=1000000, rms_norm_eps=1e-6),
        vocab_size=TALKER_VOCAB, num_code_groups=NUM_CODE_GROUPS, hidden_act="silu", max_position_embeddings=32768,
        rms_norm_eps=1e-6, rope_theta=1000000,
        text_vocab_size=(len(tok) + 63) // 64 * 64,
        codec_language_id=languages,
        spk_id=dict(SPEAKER_IDS) if model_type == "custom_voice" else {},
        spk_is_dialect={k: SPEAKER_DIALECT.get(k, False) for k in SPEAKER_IDS} if model_type == "custom_voice" else {},
    )
    return Qwen3TTSConfig(
        talker_config=talker,
        speaker_encoder_config=dict(dict(enc_kernel_sizes=[5, 3, 3, 3, 1], enc_dilations=[1, 2, 3, 4, 1]),
                                    **REDUCED["speaker_encoder"], mel_dim=128, sample_rate=24000),
        tokenizer_type="qwen3_tts_tokenizer_12hz",
        # "1b7" as released: generate_custom_voice drops the instruction when `tts_model_size in "0b6"`
        tts_model_size="1b7",
        tts_model_type=model_type,
        im_start_token_id=ids("<|im_start|>"), im_end_token_id=ids("<|im_end|>"),
        tts_pad_token_id=ids("<tts_pad>"), tts_bos_token_id=ids("<tts_text_bos>"), tts_eos_token_id=ids("<tts_text_eod>"),
        architectures=["Qwen3TTSForConditionalGeneration"],
    )


def codec_config():
    """The 12 Hz speech tokenizer's Qwen3TTSTokenizerV2Config at the reduced sizes (24 kHz, 1920 samples a frame)."""
    from qwen_tts.core import Qwen3TTSTokenizerV2Config

    encoder = dict(REDUCED["codec_encoder"], sampling_rate=24000, frame_rate=12.5, audio_channels=1,
                   upsampling_ratios=[8, 6, 5, 4], codebook_size=CODEBOOK_SIZE,
                   num_quantizers=ENCODER_QUANTIZERS or NUM_CODE_GROUPS,
                   num_semantic_quantizers=1, sliding_window=250, max_position_embeddings=8000, use_cache=False)
    decoder = dict(dict(upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2]), **REDUCED["codec_decoder"],
                   codebook_size=CODEBOOK_SIZE, num_quantizers=NUM_CODE_GROUPS, sliding_window=72,
                   max_position_embeddings=8000)
    return Qwen3TTSTokenizerV2Config(
        encoder_config=encoder, decoder_config=decoder, encoder_valid_num_quantizers=NUM_CODE_GROUPS,
        input_sample_rate=24000, output_sample_rate=24000, decode_upsample_rate=1920, encode_downsample_rate=1920,
        architectures=["Qwen3TTSTokenizerV2Model"],
    )


# --------------------------------------------------------------------------- clips

# Deterministic synthetic "voices": a few harmonics of a slowly gliding f0 with vibrato, an
# amplitude envelope with two syllable-like bumps, plus seeded noise; written as PCM16 mono.
CLIPS_SPEC = {
    # name: (sample rate, samples, f0 Hz, seed). 16 kHz is resampled to 24 kHz by upstream
    # (librosa.resample, soxr_hq); 24 kHz is used as is. Neither length is a whole number of
    # 1920-sample codec frames at 24 kHz (40800 -> 21.25, 31200 -> 16.25 frames).
    "clip16k_1p7s.wav": (16000, 27200, 140.0, 11),
    "clip24k_1p3s.wav": (24000, 31200, 210.0, 12),
}


def _make_clip(path: Path, sr: int, n: int, f0: float, seed: int, channels: int = 1) -> None:
    import numpy as np
    import soundfile as sf

    rng = np.random.default_rng(seed)
    t = np.arange(n, dtype=np.float64) / sr
    freq = f0 * (1.0 + 0.08 * t / t[-1]) * (1.0 + 0.01 * np.sin(2 * np.pi * 5.0 * t))
    phase = 2 * np.pi * np.cumsum(freq) / sr
    voice = sum(a * np.sin(k * phase + p) for k, a, p in ((1, 1.0, 0.0), (2, 0.5, 0.3), (3, 0.3, 1.1), (5, 0.12, 2.0)))
    env = 0.15 + np.exp(-((t - 0.3 * t[-1]) / (0.15 * t[-1])) ** 2) + 0.8 * np.exp(-((t - 0.72 * t[-1]) / (0.12 * t[-1])) ** 2)
    x = 0.22 * env * voice / 1.92 + 0.02 * rng.standard_normal(n)
    if channels > 1:  # stereo (variant clips): the channels differ in level and noise; upstream averages them
        x = np.stack([x * (1.0 - 0.3 * c) + 0.01 * rng.standard_normal(n) for c in range(channels)], axis=1)
    sf.write(str(path), np.clip(x, -0.99, 0.99).astype(np.float32), sr, subtype="PCM_16")


# --------------------------------------------------------------------------- build


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def build() -> None:
    import torch
    from qwen_tts.core import Qwen3TTSTokenizerV2Model
    from qwen_tts.core.models import Qwen3TTSForConditionalGeneration, Qwen3TTSProcessor

    torch.set_num_threads(THREADS)
    CLIPS.mkdir(parents=True, exist_ok=True)
    if not (FIXTURES / "cpu.json").is_file():  # a new tree (`--tree`): its own recording holds for this class
        _write_json(FIXTURES / "cpu.json", {
            "recorded_on": [_cpu_recordings().this_class().name],
            "why": f"written by record.py build (variant {VARIANT}) on {_machine()}",
        })
    for name, (sr, n, f0, seed, *channels) in CLIPS_SPEC.items():
        _make_clip(CLIPS / name, sr, n, f0, seed, *channels)

    MODELS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "bpe").mkdir()
        tok = _text_tokenizer(tmp / "bpe")

        torch.manual_seed(BUILD_SEEDS["codec"])
        codec = Qwen3TTSTokenizerV2Model(codec_config())
        _randomize(codec, BUILD_SEEDS["codec"])
        with torch.no_grad():
            last = codec.decoder.decoder[-1].conv
            last.weight.mul_(INIT["codec_decoder_last_conv_scale"])
            last.bias.zero_()
        codec_dir = tmp / "speech_tokenizer"
        codec.save_pretrained(str(codec_dir), safe_serialization=True)
        _write_json(codec_dir / "preprocessor_config.json", {
            "feature_extractor_type": "EncodecFeatureExtractor", "feature_size": 1, "sampling_rate": 24000,
            "padding_side": "right", "padding_value": 0.0, "return_attention_mask": True,
            "chunk_length_s": None, "overlap": None,
        })
        _write_json(codec_dir / "configuration.json", {"framework": "pytorch", "task": "feature-extraction"})

        weights = {}
        for model_type in ("base", "custom_voice", "voice_design"):
            out = MODELS / model_type
            if out.is_dir():
                shutil.rmtree(out)
            cfg = tts_config(model_type, tok)
            seed = BUILD_SEEDS.get(model_type, BUILD_SEEDS["custom_voice"])
            torch.manual_seed(seed)
            model = Qwen3TTSForConditionalGeneration(cfg)
            if model_type == "voice_design":  # the same weights as custom_voice (same keys)
                model.load_state_dict(weights["custom_voice"])
            else:
                _randomize(model, seed)
                _tilt_stop(model, cfg.tts_pad_token_id, STOP_WEIGHT.get(model_type))
                weights[model_type] = {k: v.detach().clone() for k, v in model.state_dict().items()}
            model.save_pretrained(str(out), safe_serialization=True)
            # Qwen3TTSSpeakerEncoderConfig.__init__ takes no **kwargs, but to_dict() adds
            # "model_type": "", which from_pretrained then passes back and fails on.
            cfg_json = json.loads((out / "config.json").read_text(encoding="utf-8"))
            cfg_json["speaker_encoder_config"].pop("model_type", None)
            _write_json(out / "config.json", cfg_json)
            _write_json(out / "generation_config.json", GENERATION_CONFIG)
            Qwen3TTSProcessor(tokenizer=tok).save_pretrained(str(out))
            for extra in ("tokenizer.json",):  # only vocab.json + merges.txt + configs, as released
                if (out / extra).exists():
                    (out / extra).unlink()
            shutil.copytree(codec_dir, out / "speech_tokenizer")
            _write_json(out / "reduced_config.json", {
                "note": "not read by upstream: what differs from the released 12 Hz models, and how the weights were made",
                "upstream": UPSTREAM, "reduced": REDUCED, "init": INIT, "build_seeds": BUILD_SEEDS,
                **({} if VARIANT == "main" else {  # the main tree's file stays byte-identical to its recording
                    "variant": VARIANT, "num_code_groups": NUM_CODE_GROUPS, "codebook_size": CODEBOOK_SIZE,
                    "talker_vocab_size": TALKER_VOCAB,
                    "encoder_quantizers": ENCODER_QUANTIZERS or NUM_CODE_GROUPS,
                    "codec_ids": CODEC_IDS,
                    "stop_weight": STOP_WEIGHT.get(model_type, INIT["stop_tilt"]["stop_weight"]),
                }),
                "weights_seed": seed, "shares_weights_with": "custom_voice" if model_type == "voice_design" else None,
                "text_tokenizer": {"merge_words": MERGE_WORDS, "special_tokens": SPECIAL_TOKENS, "length": len(tok)},
                "generation_config": GENERATION_CONFIG,
            })
            n = sum(p.numel() for p in model.parameters())
            print(f"models/{model_type}: {n} parameters")
    digests = {m: hashlib.sha256((MODELS / m / "model.safetensors").read_bytes()).hexdigest()[:16]
               for m in ("base", "custom_voice", "voice_design")}
    assert digests["custom_voice"] == digests["voice_design"], digests
    print(f"model.safetensors sha256: {digests} (custom_voice and voice_design identical)")


# --------------------------------------------------------------------------- cases

REF_TEXT_16K = "The reference clip is a calm voice speaking slowly."
REF_TEXT_24K = "Hello, this is the reference."

# name: (model, method, kwargs without max_new_tokens, seed, max_new_tokens, what it shows).
# Paths are relative to tests/fixtures/. Every other sampling argument comes from the model dir's
# generation_config.json through upstream's _merge_generate_kwargs (recorded in case.json).
CASES_SPEC = {
    "base_icl_16k": ("base", "generate_voice_clone", {
        "text": "Hello world, the voice in this clip is calm and warm.", "language": "English",
        "ref_audio": "clips/clip16k_1p7s.wav", "ref_text": REF_TEXT_16K,
    }, 0, 28, "ICL clone, 16 kHz clip (resampled), text longer than the reference codes: streaming text trails"),
    "base_icl_24k_short_text": ("base", "generate_voice_clone", {
        "text": "Speak.", "language": "Auto",
        "ref_audio": "clips/clip24k_1p3s.wav", "ref_text": REF_TEXT_24K,
    }, 2, 20, "ICL clone, 24 kHz clip, language auto, text shorter than the reference codes: padded with tts_pad"),
    "base_icl_non_streaming": ("base", "generate_voice_clone", {
        "text": "Hello world, this is a test.", "language": "English",
        "ref_audio": "clips/clip24k_1p3s.wav", "ref_text": REF_TEXT_24K, "non_streaming_mode": True,
    }, 3, 20, "ICL clone with non_streaming_mode=True (the clone default is False)"),
    "base_xvec_24k": ("base", "generate_voice_clone", {
        "text": "Hello world, the voice is warm.", "language": "English",
        "ref_audio": "clips/clip24k_1p3s.wav", "x_vector_only_mode": True,
    }, 1, 24, "x-vector-only clone (speaker embedding, no reference codes), 24 kHz clip"),
    "base_xvec_sampling": ("base", "generate_voice_clone", {
        "text": "Please speak to the test in a calm voice.", "language": "German",
        "ref_audio": "clips/clip16k_1p7s.wav", "x_vector_only_mode": True,
        "top_k": 10, "top_p": 0.8, "temperature": 0.7, "repetition_penalty": 1.3,
        "subtalker_top_k": 20, "subtalker_top_p": 0.9, "subtalker_temperature": 1.1,
    }, 4, 24, "x-vector-only clone, 16 kHz clip, every sampling knob off its default"),
    "custom_vivian_auto": ("custom_voice", "generate_custom_voice", {
        "text": "Hello world, this is a test.", "speaker": "Vivian", "language": "Auto",
    }, 0, 24, "preset speaker, language auto (nothink prefix, no language id), no instruction"),
    "custom_dylan_dialect_instruct": ("custom_voice", "generate_custom_voice", {
        "text": "你好，今天天气很好。", "speaker": "Dylan", "language": "Chinese",
        "instruct": "Speak in a calm and warm voice.",
    }, 1, 24, "dialect speaker: language Chinese becomes beijing_dialect (2074); instruction; multi-byte text"),
    "custom_ryan_streaming": ("custom_voice", "generate_custom_voice", {
        "text": "Hello world, the voice is slow and calm.", "speaker": "Ryan", "language": "English",
        "non_streaming_mode": False,
    }, 5, 24, "preset speaker with non_streaming_mode=False (the custom-voice default is True)"),
    "custom_greedy": ("custom_voice", "generate_custom_voice", {
        "text": "Hello world, this is a test.", "speaker": "Eric", "language": "Auto",
        "non_streaming_mode": False, "do_sample": False, "subtalker_dosample": False,
    }, 6, 20, "greedy talker and code predictor (no draws), streaming text; dialect speaker with language auto (sichuan_dialect)"),
    "design_instruct": ("voice_design", "generate_voice_design", {
        "text": "Hello world, this is a test of the voice.", "language": "English",
        "instruct": "A warm voice, calm and slow.",
    }, 0, 24, "voice design from an instruction"),
    "design_instruct_seed7": ("voice_design", "generate_voice_design", {
        "text": "Hello world, this is a test of the voice.", "language": "English",
        "instruct": "A warm voice, calm and slow.",
    }, 7, 24, "design_instruct with another seed"),
}

KEY_DOC = {
    "input_ids": "text ids of <|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>assistant\\n [1, L]",
    "instruct_ids": "text ids of <|im_start|>user\\n{instruct}<|im_end|>\\n [1, Li] (instruction cases)",
    "ref_ids": "text ids of <|im_start|>assistant\\n{ref_text}<|im_end|>\\n [1, Lr] (ICL clone)",
    "ref_wav_24k": "clone: the 24 kHz float32 wav the speaker encoder and the codec encoder got (librosa.load, sr=None; librosa.resample soxr_hq to 24 kHz when the clip is not 24 kHz) [S]",
    "speaker_mel": "clone: the speaker encoder's input, upstream's mel_spectrogram of ref_wav_24k (n_fft 1024, hop 256, 128 mels, log) [1, T, 128]",
    "speaker_embedding": "clone: extract_speaker_embedding's output, the x-vector spliced into the codec prefix [H]",
    "ref_codes": "ICL clone: the 12 Hz codec encoder's codes of ref_wav_24k [Tr, 16] (Tr = ceil(S / 1920))",
    "talker_inputs_embeds": "the talker's prefill inputs_embeds handed to talker.generate [1, P, H]",
    "trailing_text_hidden": "text rows added to the talker's input at steps 0, 1, ... (then tts_pad) [1, Tt, H]",
    "tts_pad_embed": "text_projection(text_embedding(<tts_pad>)) [1, 1, H]",
    "talker_first_logits": "the codec head's logits at the last prefill position (before repetition penalty, suppression, warpers) [3072]",
    "talker_hidden": "the codec head's input (talker's last hidden state after the final norm) at the last position of each talker forward [N, H]",
    "predictor_first_logits": "the code predictor's logits for frame 0, codebooks 1..15 in order (before warpers) [15, 2048]",
    "talker_tokens": "every token the talker's generate produced (first codebook of each frame; the last one is the stop 2150 when drawn) [N]",
    "codes": "generate()'s codes: every completed frame's 16 codes (codebook 0 from the talker, 1..15 from the code predictor), cut before the first stop [F, 16]",
    "decoder_wav": "ICL clone: the codec decoder's output for ref_codes + codes before any trimming [(Tr + F) * 1920]",
    "wav": "the returned waveform (wavs[0], float32 numpy, at sample_rate) [S_out]",
}


# --------------------------------------------------------------------------- variants and other trees

# `--variant alt`: a second recipe for a tree of the same layout (written with `--tree DIR`, never into
# the committed fixtures/), so a port is checked against other sizes, ids, seeds, clips and texts than
# the committed tree's. Each entry replaces module globals of the same name before anything runs.
_ALT_CODEC_IDS = {  # other control ids (all >= vocab - 1024, inside upstream's suppressed range but for the stop)
    "codec_eos_token_id": 1203, "codec_think_id": 1207, "codec_nothink_id": 1208,
    "codec_think_bos_id": 1209, "codec_think_eos_id": 1210, "codec_pad_id": 1201, "codec_bos_id": 1202,
}
_ALT_REF_TEXT = "Hello, the voice of this reference clip is warm."
VARIANTS = {
    "alt": {
        "REDUCED": {
            "talker": {
                "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
                "rope_scaling": {"rope_type": "default", "mrope_section": [2, 1, 1], "interleaved": True},
                "text_hidden_size": 40,
            },
            "code_predictor": {  # as wide as the talker: small_to_mtp_projection is an Identity, as in 0.6B
                "hidden_size": 32, "intermediate_size": 40, "num_hidden_layers": 1,
                "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
            },
            "speaker_encoder": {
                "enc_dim": 32, "enc_channels": [24, 24, 24, 24, 72], "enc_attention_channels": 12,
                "enc_res2net_scale": 4, "enc_se_channels": 12,
                "enc_kernel_sizes": [3, 5, 3, 3, 1], "enc_dilations": [1, 2, 2, 3, 1],
            },
            "codec_encoder": {
                "hidden_size": 48, "num_filters": 2, "num_residual_layers": 1, "codebook_dim": 6,
                "vector_quantization_hidden_dimension": 6, "num_hidden_layers": 2, "intermediate_size": 64,
                "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 12, "upsample_groups": 48,
            },
            "codec_decoder": {
                "hidden_size": 24, "latent_dim": 48, "intermediate_size": 40, "num_attention_heads": 3,
                "num_key_value_heads": 1, "head_dim": 8, "num_hidden_layers": 2, "codebook_dim": 12,
                "decoder_dim": 48, "upsample_rates": [6, 5, 4, 4], "upsampling_ratios": [2, 2],
            },
        },
        "NUM_CODE_GROUPS": 8,
        "ENCODER_QUANTIZERS": 10,  # Mimi computes 10 codes a frame; the speech tokenizer keeps the first 8
        # a longer text vocabulary: every special token's id and text_vocab_size (448) move
        "MERGE_WORDS": [*MERGE_WORDS, "Ġsoft", "Ġbright", "Ġquiet", "Ġloud", "Ġhappy", "Ġsad", "Ġfast", "Ġdeep",
                        "Ġhigh", "Ġlow", "Ġspeaker", "Ġmorning", "Ġevening", "Ġweather", "Ġtoday", "Ġtomorrow",
                        "Ġwonderful", "Ġbeautiful", "Ġsentence", "Ġlanguage"],
        "CODEBOOK_SIZE": 1024,  # half the released codebook, and the talker's vocabulary with it (1024 + 1024)
        "TALKER_VOCAB": 2048,
        "CODEC_IDS": _ALT_CODEC_IDS,
        "LANGUAGE_IDS": {
            "chinese": 1101, "english": 1102, "german": 1103, "italian": 1104, "portuguese": 1105,
            "spanish": 1106, "japanese": 1107, "korean": 1108, "french": 1109, "russian": 1110,
        },
        "DIALECT_IDS": {"beijing_dialect": 1121, "sichuan_dialect": 1122},
        "SPEAKER_IDS": {
            "serena": 1801, "vivian": 1802, "uncle_fu": 1803, "ryan": 1804, "aiden": 1805,
            "ono_anna": 1806, "sohee": 1807, "eric": 1808, "dylan": 1809,
        },
        "SPEAKER_DIALECT": {"uncle_fu": "sichuan_dialect", "dylan": "beijing_dialect"},
        "BUILD_SEEDS": {"codec": 77, "base": 2718, "custom_voice": 3141},
        # custom_voice / voice_design: no stop tilt at all, so decodes run to max_new_tokens (one past the
        # codec decoder's 72-frame sliding window) unless a draw lands on the stop code by chance
        "STOP_WEIGHT": {"custom_voice": 0.0},
        "CLIPS_SPEC": {
            # (sample rate, samples, f0 Hz, seed, channels): 22.05 kHz mono and 44.1 kHz stereo, both resampled
            "clip22k_1p1s.wav": (22050, 24255, 180.0, 21),
            "clip44k_stereo_0p9s.wav": (44100, 39690, 120.0, 22, 2),
        },
        "CASES_SPEC": {
            "alt_icl_22k": ("base", "generate_voice_clone", {
                "text": "The voice is warm and slow.", "language": "French",
                "ref_audio": "clips/clip22k_1p1s.wav", "ref_text": _ALT_REF_TEXT,
            }, 11, 30, "ICL clone, 22.05 kHz clip, French"),
            "alt_icl_stereo_short": ("base", "generate_voice_clone", {
                "text": "Test.", "language": "Japanese",
                "ref_audio": "clips/clip44k_stereo_0p9s.wav", "ref_text": "Please speak.",
            }, 12, 16, "ICL clone, 44.1 kHz stereo clip (averaged to mono), text shorter than the reference codes"),
            "alt_xvec_stereo": ("base", "generate_voice_clone", {
                "text": "Hello world, this is the test.", "language": "Korean",
                "ref_audio": "clips/clip44k_stereo_0p9s.wav", "x_vector_only_mode": True,
                "top_k": 5, "temperature": 1.2, "subtalker_top_k": 7,
            }, 13, 30, "x-vector-only clone, stereo clip, sampling knobs"),
            "alt_custom_long": ("custom_voice", "generate_custom_voice", {
                "text": "Hello world, the voice is calm.", "speaker": "Serena", "language": "Spanish",
            }, 14, 100, "no stop tilt: runs past the codec decoder's 72-frame sliding window"),
            "alt_custom_dialect_greedy": ("custom_voice", "generate_custom_voice", {
                "text": "你好。", "speaker": "Uncle_Fu", "language": "Chinese", "instruct": "Speak slowly.",
                "non_streaming_mode": False, "do_sample": False, "subtalker_dosample": False,
            }, 15, 12, "dialect speaker (sichuan), greedy, streaming text, instruction"),
            "alt_design_italian": ("voice_design", "generate_voice_design", {
                "text": "Hello, this is a voice.", "language": "Italian", "instruct": "A calm voice.",
            }, 16, 14, "voice design, Italian"),
        },
    },
}


def apply_variant(name: str) -> None:
    """Replace the recipe's module globals with variant `name`'s (VARIANTS)."""
    global VARIANT
    for key, value in VARIANTS[name].items():
        assert key in globals(), key
        globals()[key] = value
    VARIANT = name


def set_tree(root: Path) -> None:
    """Write and read the tree at `root` instead of tests/fixtures/ (`--tree`)."""
    global FIXTURES, MODELS, CLIPS, CASES
    FIXTURES = Path(root).resolve()
    MODELS, CLIPS, CASES = FIXTURES / "models", FIXTURES / "clips", FIXTURES / "cases"


def _resolve(kwargs: dict) -> dict:
    out = dict(kwargs)
    if "ref_audio" in out:
        out["ref_audio"] = str(FIXTURES / out["ref_audio"])
    return out


def _load(model_name: str):
    import torch
    from qwen_tts import Qwen3TTSModel

    kwargs = dict(FROM_PRETRAINED, dtype=getattr(torch, FROM_PRETRAINED["dtype"]))
    return Qwen3TTSModel.from_pretrained(str(MODELS / model_name), **kwargs)


class Observer:
    """Wraps upstream calls on one model instance; arguments and results pass through unchanged."""

    def __init__(self, tts):
        import numpy as np
        import torch

        rec: dict = {}
        self.rec = rec
        self.meta: dict = {"multinomial_calls": 0, "decoder_calls": 0, "talker_forwards": 0}
        meta = self.meta
        model = tts.model
        talker = model.talker
        self._hooks = []
        self._restore = []

        def np_tensor(x):
            return torch.from_numpy(np.array(x, dtype=np.float32, copy=True))

        gen = model.generate

        def model_generate(*args, **kwargs):
            rec["input_ids"] = kwargs["input_ids"][0].clone()
            if kwargs.get("instruct_ids") and kwargs["instruct_ids"][0] is not None:
                rec["instruct_ids"] = kwargs["instruct_ids"][0].clone()
            if kwargs.get("ref_ids") and kwargs["ref_ids"][0] is not None:
                rec["ref_ids"] = kwargs["ref_ids"][0].clone()
            prompt = kwargs.get("voice_clone_prompt")
            if prompt is not None:
                rec["speaker_embedding"] = prompt["ref_spk_embedding"][0].clone()
                if prompt["ref_code"][0] is not None:
                    rec["ref_codes"] = prompt["ref_code"][0].clone()
            meta["model_generate_kwargs"] = {k: v for k, v in kwargs.items()
                                             if k not in ("input_ids", "instruct_ids", "ref_ids", "voice_clone_prompt")}
            codes, hiddens = gen(*args, **kwargs)
            rec["codes"] = codes[0].clone()
            return codes, hiddens

        model.generate = model_generate

        talker_gen = talker.generate

        def talker_generate(*args, **kwargs):
            rec["talker_inputs_embeds"] = kwargs["inputs_embeds"].clone()
            rec["trailing_text_hidden"] = kwargs["trailing_text_hidden"].clone()
            rec["tts_pad_embed"] = kwargs["tts_pad_embed"].clone()
            assert bool(kwargs["attention_mask"].all()), "batch of one: no padding"
            meta["talker_generate_kwargs"] = {k: v for k, v in kwargs.items() if not torch.is_tensor(v)}
            out = talker_gen(*args, **kwargs)
            rec["talker_tokens"] = out.sequences[0].clone()
            return out

        talker.generate = talker_generate

        hidden_rows: list = []

        def codec_head_hook(module, args, output):
            meta["talker_forwards"] += 1
            if "talker_first_logits" not in rec:
                rec["talker_first_logits"] = output[0, -1].detach().clone()
            hidden_rows.append(args[0][0, -1].detach().clone())

        self._hooks.append(talker.codec_head.register_forward_hook(codec_head_hook))
        self._hidden_rows = hidden_rows

        predictor_rows: list = []

        def predictor_hook(module, args, kwargs, output):
            if len(predictor_rows) < NUM_CODE_GROUPS - 1:
                predictor_rows.append(output.logits[0, -1].detach().clone())

        self._hooks.append(talker.code_predictor.register_forward_hook(predictor_hook, with_kwargs=True))
        self._predictor_rows = predictor_rows

        if model.speaker_encoder is not None:
            extract = model.extract_speaker_embedding

            def extract_speaker_embedding(audio, sr):
                rec["ref_wav_24k"] = np_tensor(audio)
                return extract(audio=audio, sr=sr)

            model.extract_speaker_embedding = extract_speaker_embedding

            def speaker_pre_hook(module, args):
                rec["speaker_mel"] = args[0].detach().clone()

            self._hooks.append(model.speaker_encoder.register_forward_pre_hook(speaker_pre_hook))

            codec_encode = model.speech_tokenizer.model.encode

            def encode(input_values, padding_mask=None, return_dict=None):
                rec["codec_input"] = input_values[0].detach().clone()
                assert padding_mask is not None and bool(padding_mask.all())
                return codec_encode(input_values, padding_mask, return_dict=return_dict)

            model.speech_tokenizer.model.encode = encode

        def decoder_hook(module, args, output):
            meta["decoder_calls"] += 1
            rec["decoder_wav"] = output[0, 0].detach().clone()

        self._hooks.append(model.speech_tokenizer.model.decoder.register_forward_hook(decoder_hook))

        decode = model.speech_tokenizer.decode

        def tokenizer_decode(encoded):
            wavs, fs = decode(encoded)
            rec["decoded_wav"] = np_tensor(wavs[0])
            return wavs, fs

        model.speech_tokenizer.decode = tokenizer_decode

        orig_multinomial = torch.multinomial

        def multinomial(*args, **kwargs):
            meta["multinomial_calls"] += 1
            return orig_multinomial(*args, **kwargs)

        torch.multinomial = multinomial
        self._restore.append((torch, "multinomial", orig_multinomial))

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        for owner, name, fn in self._restore:
            setattr(owner, name, fn)

    def tensors(self, wav) -> dict:
        import torch

        rec = {k: v.detach().cpu().clone().contiguous() for k, v in self.rec.items()}
        rec["talker_hidden"] = torch.stack(self._hidden_rows).contiguous()
        if self._predictor_rows:
            assert len(self._predictor_rows) == NUM_CODE_GROUPS - 1
            rec["predictor_first_logits"] = torch.stack(self._predictor_rows).contiguous()
        rec["wav"] = torch.from_numpy(wav.copy()).contiguous()
        assert rec["wav"].dtype == torch.float32
        # left out of the record because they equal recorded tensors (checked here)
        if "codec_input" in rec:
            assert torch.equal(rec.pop("codec_input"), rec["ref_wav_24k"])
        decoded = rec.pop("decoded_wav")
        frames = rec["codes"].shape[0] + (rec["ref_codes"].shape[0] if "ref_codes" in rec else 0)
        assert decoded.shape[0] == frames * 1920 and torch.equal(decoded, rec["decoder_wav"][: frames * 1920])
        if "ref_codes" not in rec:
            assert torch.equal(rec["wav"], decoded), "no reference codes: the returned wav is the decode"
            assert rec["decoder_wav"].shape[0] == frames * 1920
            rec.pop("decoder_wav")
        else:
            assert torch.equal(rec["wav"], decoded[decoded.shape[0] - rec["wav"].shape[0]:])
        return rec


def record_case(name: str, out_root: Path, cpu_fields: dict | None = None) -> dict:
    import numpy as np
    import torch
    from safetensors.torch import save_file

    model_name, method, kwargs, seed, max_new_tokens, what = CASES_SPEC[name]
    call = dict(kwargs, max_new_tokens=max_new_tokens)
    case_dir = out_root / name
    case_dir.mkdir(parents=True, exist_ok=True)

    torch.set_num_threads(THREADS)
    tts = _load(model_name)
    obs = Observer(tts)
    torch.manual_seed(seed)
    try:
        wavs, sr = getattr(tts, method)(**_resolve(call))
    finally:
        obs.close()
    assert len(wavs) == 1 and isinstance(wavs[0], np.ndarray)
    tensors = obs.tensors(wavs[0])
    for k, v in tensors.items():
        assert torch.isfinite(v.float()).all(), f"{name}: {k} not finite"
    save_file(tensors, str(case_dir / "record.safetensors"))

    stop = CODEC_IDS["codec_eos_token_id"]
    tokens = tensors["talker_tokens"]
    gen_kwargs = {k: v for k, v in obs.meta["model_generate_kwargs"].items()}
    talker_kwargs = dict(obs.meta["talker_generate_kwargs"])
    suppress = talker_kwargs.pop("suppress_tokens")
    talker_kwargs["suppress_tokens"] = f"{len(suppress)} ids: {suppress[0]}..{suppress[-1]} except {stop}"
    frames = int(tensors["codes"].shape[0])
    meta = {
        "upstream": UPSTREAM,
        "class": "Qwen3TTSModel",
        "model": model_name,
        "model_dir": f"models/{model_name}",
        "from_pretrained": dict(FROM_PRETRAINED),
        "attn_implementation": tts.model.config._attn_implementation,
        "method": method,
        "kwargs": call,
        "what": what,
        "seed": seed,
        "seeding": "torch.manual_seed(seed) right after from_pretrained, before the one generate_* call",
        "torch_threads": THREADS,
        "dtype": "float32",
        "device": "cpu",
        **(cpu_fields or {}),
        "model_generate_kwargs": gen_kwargs,
        "talker_generate_kwargs": talker_kwargs,
        "talker_tokens": int(tokens.numel()),
        "frames": frames,
        "stopped": bool((tokens == stop).any()),
        "multinomial_calls": obs.meta["multinomial_calls"],
        "sample_rate": int(sr),
        "output_samples": int(tensors["wav"].numel()),
        "output_seconds": round(tensors["wav"].numel() / sr, 3),
        "tensors": {k: {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", ""), "what": KEY_DOC[k]}
                    for k, v in sorted(tensors.items())},
    }
    assert obs.meta["decoder_calls"] == 1, "one chunk (< 300 frames): chunked_decode calls the decoder once"
    assert obs.meta["talker_forwards"] == tokens.numel()
    (case_dir / "case.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return meta


def record(names: list[str], out_root: Path, cpu_fields: dict | None = None) -> None:
    for name in names:
        meta = record_case(name, out_root, cpu_fields)
        print(f"{name}: {meta['talker_tokens']} talker tokens, {meta['frames']} frames, stopped={meta['stopped']}, "
              f"{meta['multinomial_calls']} draws, {meta['output_seconds']} s")


def _plain_output(name: str):
    """The returned waveform of a case with no observer installed (observing changes nothing)."""
    import torch

    model_name, method, kwargs, seed, max_new_tokens, _ = CASES_SPEC[name]
    torch.set_num_threads(THREADS)
    tts = _load(model_name)
    torch.manual_seed(seed)
    wavs, sr = getattr(tts, method)(**_resolve(dict(kwargs, max_new_tokens=max_new_tokens)))
    return torch.from_numpy(wavs[0].copy()), sr


def _read(case_dir: Path) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    return (json.loads((case_dir / "case.json").read_text(encoding="utf-8")),
            load_file(str(case_dir / "record.safetensors")))


def _float_diffs(base: dict, other: dict) -> dict[str, float]:
    """max |other - base| of every float tensor that is not torch.equal (same keys, shapes, dtypes assumed)."""
    import torch

    return {k: (other[k].double() - base[k].double()).abs().max().item() for k in sorted(base)
            if base[k].is_floating_point() and not torch.equal(base[k], other[k])}


def class_problems(name: str, own_dir: Path, class_dir: Path) -> list[str]:
    """What keeps a class recording of a case from standing beside the tree's own (empty: nothing).

    The same keys, dtypes and shapes (the comparison code reads whole records), every integer tensor
    (ids, reference codes, talker tokens, codes) torch.equal, and case.json equal but for CLASS_FIELDS.
    """
    import torch

    (own_meta, own), (meta, rec) = _read(own_dir), _read(class_dir)
    out = []
    if own.keys() != rec.keys():
        out.append(f"{name}: keys differ: {sorted(own.keys() ^ rec.keys())}")
    for k in sorted(own.keys() & rec.keys()):
        a, b = own[k], rec[k]
        if a.dtype != b.dtype or a.shape != b.shape:
            out.append(f"{name}: {k} is {b.dtype} {tuple(b.shape)}, the tree's own {a.dtype} {tuple(a.shape)}")
        elif not a.is_floating_point() and not torch.equal(a, b):
            out.append(f"{name}: integer tensor {k} differs from the tree's own recording")
    stripped = {k: v for k, v in meta.items() if k not in CLASS_FIELDS}
    changed = sorted(k for k in own_meta.keys() | stripped.keys() if own_meta.get(k) != stripped.get(k))
    if changed:
        out.append(f"{name}: case.json fields differ from the tree's own: {changed}")
    if "cpu_class" not in meta:
        out.append(f"{name}: case.json names no cpu_class")
    return out


def _same_record(a: Path, b: Path) -> bool:
    """Both case folders hold a record, with the same keys and torch.equal tensors."""
    import torch

    if not all((d / "record.safetensors").is_file() for d in (a, b)):
        return False
    x, y = _read(a)[1], _read(b)[1]
    return x.keys() == y.keys() and all(x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]) for k in x)


def record_class(names: list[str], cpu, target: Path) -> int:
    """Record `names` for class `cpu` into `target` (its cpu/<folder>/cases), checked against the tree's own."""
    fields = class_fields(cpu)
    missing = [n for n in names if not (CASES / n / "record.safetensors").is_file()]
    if missing:
        print(f"no recording of the tree's own for {missing}: record them first (`record` on class(es) "
              f"{json.loads((FIXTURES / 'cpu.json').read_text())['recorded_on']})")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        record(names, Path(tmp), fields)
        problems, differs = [], {}
        for name in names:
            found = class_problems(name, CASES / name, Path(tmp) / name)
            problems += found
            if not found:
                differs[name] = _float_diffs(_read(CASES / name)[1], _read(Path(tmp) / name)[1])
        if problems:
            print(f"class {cpu}: NOT stored, the recording does not stand beside the tree's own:")
            print("\n".join(f"  {p}" for p in problems))
            return 1
        for name in names:
            what = ", ".join(f"{k} {v:.3g}" for k, v in differs[name].items()) or "every tensor torch.equal"
            print(f"{name}: {what}")
        existing = sorted(p.name for p in target.glob("*") if (p / "case.json").is_file())
        if not any(differs.values()) and not existing:
            print(f"class {cpu} reproduces the tree's own recording bit for bit in these {len(names)} cases: "
                  f"nothing stored (if it holds for every case, name {cpu} in fixtures/cpu.json `recorded_on`)")
            return 0
        for folder in sorted(p for p in target.parent.parent.glob("*") if p != target.parent):
            if all(_same_record(folder / "cases" / n, Path(tmp) / n) for n in names):
                print(f"note: {folder.name} holds the same tensors for these cases (git stores the files once)")
        for name in names:
            dest = target / name
            if dest.exists():
                shutil.rmtree(dest)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(Path(tmp) / name, dest)
        print(f"class {cpu}: {len(names)} cases written to {target.relative_to(FIXTURES)}/")
    return 0


def verify(names: list[str], tree: Path = CASES) -> int:
    """Rerun without observers, then re-record into a temp tree and compare every tensor with `tree`'s."""
    import torch

    cpu_fields = None
    if tree != CASES:
        cpu_fields = class_fields(_cpu_recordings().this_class())
        absent = [n for n in names if not (tree / n / "record.safetensors").is_file()]
        if absent:
            print(f"{tree.relative_to(FIXTURES)} has no recording of {absent} (`record` stores a class only where "
                  "some float tensor differs from the tree's own; `record` again to see whether this one does)")
            return 1
    bad = 0
    for name in names:
        wav, sr = _plain_output(name)
        meta, rec = _read(tree / name)
        same = torch.equal(wav, rec["wav"]) and sr == meta["sample_rate"]
        bad += not same
        print(f"{name}: output without observers {'equal' if same else 'DIFFERS'}")
    with tempfile.TemporaryDirectory() as tmp:
        record(names, Path(tmp), cpu_fields)
        for name in names:
            (ja, a), (jb, b) = _read(tree / name), _read(Path(tmp) / name)
            same = a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
            if cpu_fields is not None:  # another machine of the class: its model name and flags may differ
                ja, jb = ({k: v for k, v in j.items() if k not in MACHINE_FIELDS} for j in (ja, jb))
                for problem in class_problems(name, CASES / name, tree / name):
                    print(f"  {problem}")
                    same = False
            same = same and ja == jb
            bad += not same
            print(f"{name}: {'bit-identical' if same else 'DIFFERS'} ({len(a)} tensors, case.json {'equal' if ja == jb else 'differs'})")
    print("all bit-identical" if not bad else f"{bad} checks differ")
    return 1 if bad else 0


def diff() -> int:
    """Per key, the largest difference between the tree's own recording and each class folder (and between folders)."""
    import torch

    cr = _cpu_recordings()
    folders = {}
    for folder in sorted(p for p in (FIXTURES / cr.CPU_FOLDER).glob("*") if (p / "cases").is_dir()):
        metas = [json.loads(m.read_text(encoding="utf-8")) for m in folder.glob("cases/*/case.json")]
        folders[cr.folder_class(folder, metas).name] = folder / "cases"
    own = "/".join(json.loads((FIXTURES / "cpu.json").read_text())["recorded_on"])
    trees = {own: CASES, **folders}
    if len(trees) < 2:
        print("no class folder under fixtures/cpu/")
        return 0
    bad = 0
    names = sorted(p.name for p in CASES.glob("*") if (p / "case.json").is_file())
    order = list(trees)
    for i, x in enumerate(order):
        for y in order[i + 1:]:
            table: dict[str, list] = {}
            for name in names:
                if not all((trees[t] / name / "record.safetensors").is_file() for t in (x, y)):
                    print(f"{y} vs {x}: {name} missing")
                    continue
                base, other = _read(trees[x] / name)[1], _read(trees[y] / name)[1]
                for k in sorted(base):
                    a, b = base[k], other.get(k)
                    row = table.setdefault(k, [str(a.dtype).replace("torch.", ""), 0.0, 0.0, 0, 0])
                    row[4] += 1
                    if b is None or b.shape != a.shape or b.dtype != a.dtype:
                        print(f"{y} vs {x}: {name} {k} missing or of another shape / dtype")
                        bad += 1
                    elif torch.equal(a, b):
                        continue
                    elif not a.is_floating_point():
                        print(f"{y} vs {x}: {name}: INTEGER tensor {k} differs")
                        bad += 1
                    else:
                        d = (b.double() - a.double()).abs().max().item()
                        scale = a.double().abs().max().item()
                        row[1], row[2], row[3] = max(row[1], d), max(row[2], d / scale if scale else 0.0), row[3] + 1
            print(f"\n{y} against {x} ({len(names)} cases): per key, max abs diff, max diff / max |{x}|, "
                  "cases where it differs")
            print("| key | dtype | max abs diff | relative | cases differing |")
            print("|---|---|---|---|---|")
            for k, (dtype, d, r, n, total) in sorted(table.items()):
                shown = ("equal" if not n else f"{d:.3g}", "" if not n else f"{r:.3g}")
                print(f"| `{k}` | {dtype} | {shown[0]} | {shown[1]} | {n} / {total} |")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("command", choices=["build", "record", "verify", "all", "diff"])
    ap.add_argument("names", nargs="*", help="case names (record / verify); default all")
    ap.add_argument("--tree", type=Path, help="the tree to write / read (default: tests/fixtures/ next to this folder)")
    ap.add_argument("--variant", choices=["main", *VARIANTS], default="main",
                    help="the recipe (VARIANTS); a variant other than main needs --tree")
    ap.add_argument("--cap", choices=sorted(ISA_CAPS),
                    help="record / verify as this narrower CPU class (ISA_CAPS sets the environment)")
    args = ap.parse_intermixed_args()
    if args.variant != "main":
        if args.tree is None or args.tree.resolve() == FIXTURES.resolve():
            ap.error("--variant writes another tree: give --tree DIR (not the committed fixtures/)")
        apply_variant(args.variant)
    if args.tree is not None:
        set_tree(args.tree)
    unknown = [n for n in args.names if n not in CASES_SPEC]
    if unknown or (args.names and args.command in ("build", "all", "diff")):
        ap.error(f"unknown cases {unknown}" if unknown else f"{args.command} takes no names")
    if args.cap and args.command not in ("record", "verify"):
        ap.error("--cap goes with record or verify")
    _reexec_with_mkl_shim(ISA_CAPS.get(args.cap))
    patch_upstream()
    names = args.names or list(CASES_SPEC)
    if args.command == "diff":
        return diff()
    if args.command in ("build", "all"):
        build()
    if args.command in ("record", "all", "verify"):
        cpu, target, own = class_target()
        fields = class_fields(cpu)
        print(f"CPU class {cpu} (torch capability {fields['torch_cpu_capability']}, ISA caps "
              f"{fields['isa_caps'] or 'none'}): {'own' if own else 'class'} recording {target.relative_to(FIXTURES)}/")
        if args.command == "verify":
            return verify(names, target)
        if own:
            record(names, CASES)
        else:
            return record_class(names, cpu, target)
    return 0


if __name__ == "__main__":
    sys.exit(main())

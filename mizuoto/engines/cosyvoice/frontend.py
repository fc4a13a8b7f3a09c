"""CosyVoice's front end: text to token ids, reference audio to a voice prompt, modes to model input.

The model input is the dict upstream's `frontend_<mode>` returns (minus the `*_len` keys that
`model.tts` ignores), so a request can be checked against upstream case by case. Every heavy
part (text normalizer, tokenizers, speech tokenizer, CAM++) loads on first use, so a model
directory that lacks, say, the ONNX files still serves the modes that do not need them.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import torch

from mizuoto.engines.cosyvoice.variants import ENDOFPROMPT, Variant
from mizuoto.nn.dsp.kaldi import kaldi_fbank, mean_normalize
from mizuoto.nn.dsp.mel import MatchaMelConfig, matcha_mel, whisper_log_mel
from mizuoto.nn.dsp.wav import load_wav
from mizuoto.engines.cosyvoice.resources import WHISPER_TIKTOKEN, fst_dir, whisper_vocab_dir
from mizuoto.errors import AudioError, InvalidRequest, ModelLoadError

SPEECH_TOKEN_RATE = 16000   # the speech tokenizer and CAM++ listen at 16 kHz
PROMPT_MEL_RATE = 24000     # upstream computes the prompt mel at 24 kHz for every generation
MAX_PROMPT_SECONDS = 30     # upstream: "do not support extract speech token for audio longer than 30s"
WHISPER_MELS = 128          # the speech tokenizer's input: Whisper log-mel, 128 bins (v1-v3)
FBANK_BINS = 80
EMBEDDINGS_KEPT = 64         # recent reference clips whose CAM++ embedding is kept (192 floats each)
# (CAM++ file, 16 kHz samples, exact) -> embedding, shared by the process's models (speaker_embedding)
_EMBEDDINGS: OrderedDict[tuple, torch.Tensor] = OrderedDict()
_EMBEDDINGS_LOCK = threading.Lock()
log = logging.getLogger("mizuoto.cosyvoice")
BLANK_EN = "CosyVoice-BlankEN"
CAMPPLUS = "campplus.onnx"

Audio = Any  # a path, bytes, or (samples, sample_rate)


def _lazy(make: Callable[[Any], Any]) -> property:
    """A part of the front end built by `make(self)` on first use, once, under the front end's lock."""
    def get(self: "CosyVoiceFrontend") -> Any:
        with self._lock:
            if make.__name__ not in self._parts:
                self._parts[make.__name__] = make(self)
            return self._parts[make.__name__]
    return property(get, doc=make.__doc__)


def forget_embeddings() -> None:
    """Drop every kept CAM++ embedding (the next clip of each is embedded anew)."""
    with _EMBEDDINGS_LOCK:
        _EMBEDDINGS.clear()


class CosyVoiceFrontend:
    """Text and voice-prompt processing for one CosyVoice model directory."""

    def __init__(self, model_dir: Path, variant: Variant, config: dict, device: torch.device | str = "cpu",
                 progress: Callable | None = None, exact_embedding: bool = True):
        self.model_dir = Path(model_dir)
        self.exact_embedding = exact_embedding  # CAM++ in onnxruntime's float order (compute.reference)
        self.variant = variant
        self.config = config
        self.device = torch.device(device)
        self.progress = progress
        feat = config.get("feat_extractor")
        if feat is None:
            raise ModelLoadError(f"{self.model_dir / variant.yaml_name}: no feat_extractor (the prompt mel settings)")
        self.mel_config = MatchaMelConfig.from_kwargs(feat.kwargs)
        self._lock = threading.RLock()  # parts build on other parts (text front end -> tokenizer)
        self._parts: dict[str, Any] = {}
        self._warned_inexact = False
        self.resources = self._find_resources()

    def _find_resources(self) -> dict[str, Path]:
        """The verified shared resources the text modes need, found now so that a missing one fails the load.

        A directory that cannot process text at all (no tokenizer files) serves voice conversion
        only and needs none.
        """
        if self.missing_files(need_audio=False):
            return {}
        found = {"wetext": fst_dir()}
        if self.variant.text_tokenizer == "whisper":
            found["whisper"] = whisper_vocab_dir(self.model_dir)
        return found

    def missing_files(self, need_audio: bool) -> list[str]:
        """Files this directory lacks for text (and, with need_audio, voice-prompt) processing."""
        missing = []
        if self.variant.text_tokenizer == "qwen":
            for name in ("vocab.json", "merges.txt"):
                if not (self.model_dir / BLANK_EN / name).is_file():
                    missing.append(f"{BLANK_EN}/{name}")
        if need_audio:
            for name in (self.variant.speech_tokenizer, CAMPPLUS):
                if not (self.model_dir / name).is_file():
                    missing.append(name)
        return missing

    # -- lazily loaded parts -------------------------------------------------------------------
    @_lazy
    def tokenizer(self):
        """The model's text tokenizer (Qwen2 BPE for v2/v3, Whisper tiktoken for v1)."""
        from mizuoto.text.tokenize import QwenTokenizer, WhisperTokenizer

        if self.variant.text_tokenizer == "whisper":
            return WhisperTokenizer.from_file(self.resources["whisper"] / WHISPER_TIKTOKEN)
        blank_en = self.model_dir / BLANK_EN
        missing = [n for n in ("vocab.json", "merges.txt") if not (blank_en / n).is_file()]
        if missing:
            raise ModelLoadError(f"{blank_en} lacks the tokenizer files {', '.join(missing)}")
        version = (self.config.get("get_tokenizer") or {}).get("version", "cosyvoice2")
        return QwenTokenizer.from_dir(blank_en, version=version)

    @_lazy
    def text_frontend(self):
        """Upstream's text_normalize over the verified wetext FSTs (the shared resource cosyvoice/wetext)."""
        from mizuoto.text.normalize import TextFrontend, WetextNormalizer

        return TextFrontend(WetextNormalizer(self.resources.get("wetext") or fst_dir()), self.tokenizer.encode)

    @_lazy
    def speech_tokenizer(self):
        """The S3 speech tokenizer of this generation, built from its ONNX file."""
        from mizuoto.runtime.convert.s3tokenizer import load_s3tokenizer

        path = self.model_dir / self.variant.speech_tokenizer
        if not path.is_file():
            raise ModelLoadError(f"{path} is missing: voice prompts from audio need it")
        return load_s3tokenizer(path, self.progress).to(self.device).eval()

    @_lazy
    def campplus(self):
        """CAM++ speaker encoder; always on the CPU, as upstream's onnxruntime CPU session."""
        from mizuoto.runtime.convert.campplus import load_campplus

        path = self.model_dir / CAMPPLUS
        if not path.is_file():
            raise ModelLoadError(f"{path} is missing: voice prompts from audio need it")
        return load_campplus(path, self.progress).eval()

    # -- text ----------------------------------------------------------------------------------
    def segments(self, text: str) -> list[str]:
        """Upstream's normalized sentence segments of `text`; an error when nothing speakable is left."""
        segments = self.text_frontend.text_normalize(text, split=True)
        if not segments:
            raise InvalidRequest(f"text has nothing to speak after normalization: {text[:60]!r}", field="text")
        return segments

    def normalize(self, text: str) -> str:
        """Upstream's normalized text without splitting (prompt and instruct texts)."""
        return self.text_frontend.text_normalize(text, split=False)

    def tokens(self, text: str) -> torch.Tensor:
        """[1, T] int32 text token ids."""
        return torch.tensor([self.tokenizer.encode(text)], dtype=torch.int32)

    def streamed_tokens(self, pieces: Iterator[str]) -> Iterator[torch.Tensor]:
        """Token ids of streamed text, one [1, 1] tensor at a time, as upstream's bistream input."""
        for piece in pieces:
            if not isinstance(piece, str):
                raise InvalidRequest(f"streamed text pieces must be strings, got {type(piece).__name__}", field="text")
            for token in self.tokenizer.encode(piece):
                yield torch.tensor([[token]], dtype=torch.int32)

    def with_system_prompt(self, text: str) -> str:
        """v3 prompts must carry <|endofprompt|>; prepend the system prompt when they lack it."""
        if self.variant.system_prompt and ENDOFPROMPT not in text:
            return self.variant.system_prompt + text
        return text

    def instruct_prompt(self, instruct: str) -> str:
        """An instruction as the models were trained on it: ending in <|endofprompt|> (v3: after its system prompt).

        v1's is normalized first, as upstream's inference_instruct does (a no-op on text with a
        `<|...|>` marker); v2/v3's never is, as upstream's inference_instruct2.
        """
        if self.variant.instruct_mode == "instruct":
            instruct = self.normalize(instruct)
        if ENDOFPROMPT in instruct:
            return instruct
        prefix = self.variant.system_prompt.replace(ENDOFPROMPT, " ") if self.variant.system_prompt else ""
        return prefix + instruct + ENDOFPROMPT

    # -- audio ---------------------------------------------------------------------------------
    @staticmethod
    def _load(audio: Audio, rate: int) -> torch.Tensor:
        if isinstance(audio, tuple) and len(audio) == 2:
            samples, source_rate = audio
            return load_wav(torch.as_tensor(samples, dtype=torch.float32), rate, source_rate=source_rate)
        return load_wav(audio, rate)

    def speech_tokens(self, audio: Audio) -> torch.Tensor:
        """[1, n] int32 speech tokens of the audio (upstream _extract_speech_token)."""
        speech = self._load(audio, SPEECH_TOKEN_RATE)
        seconds = speech.shape[1] / SPEECH_TOKEN_RATE
        if seconds > MAX_PROMPT_SECONDS:
            raise AudioError(f"reference audio is {seconds:.1f} s; at most {MAX_PROMPT_SECONDS} s is supported",
                             field="reference")
        mel = whisper_log_mel(speech, n_mels=WHISPER_MELS)
        tokenizer = self.speech_tokenizer
        with torch.inference_mode():
            device = next(tokenizer.parameters()).device
            tokens, lengths = tokenizer(mel.to(device), torch.tensor([mel.shape[2]], device=device))
        return tokens[:, :int(lengths[0])].to(torch.int32).cpu()

    def speaker_embedding(self, audio: Audio, onnxruntime_order: bool | None = None) -> torch.Tensor:
        """[1, 192] CAM++ embedding (upstream _extract_spk_embedding).

        `onnxruntime_order` (default: the frontend's `exact_embedding`, the load option
        compute.reference) evaluates CAM++ in onnxruntime's CPU float32 order: upstream's numbers,
        not just close ones, in about half a second to a second a clip instead of tens of
        milliseconds. Where onnxruntime's order is not reproduced (a CPU without AVX2 and FMA3)
        torch's kernels run, with a warning. The last EMBEDDINGS_KEPT embeddings are kept by the
        clip's 16 kHz samples (and CAM++ file), so a reference sent with every request costs this once.
        """
        speech = self._load(audio, SPEECH_TOKEN_RATE)
        exact = self.exact_embedding if onnxruntime_order is None else onnxruntime_order
        if exact:
            from mizuoto.nn.speaker import campplus_ort

            if not campplus_ort.reproducible_here():
                exact = False
                if not self._warned_inexact:
                    self._warned_inexact = True
                    log.warning("CAM++ runs with torch's kernels: onnxruntime's float order is not reproduced on a "
                                "CPU without AVX2 and FMA3, so embeddings are close to upstream's, not equal")
        key = (self._campplus_identity(), hashlib.sha256(speech.contiguous().numpy().tobytes()).hexdigest(),
               speech.shape[1], exact)
        with _EMBEDDINGS_LOCK:
            found = _EMBEDDINGS.get(key)
            if found is not None:
                _EMBEDDINGS.move_to_end(key)
                return found.clone()
        feats = mean_normalize(kaldi_fbank(speech, num_mel_bins=FBANK_BINS, sample_frequency=SPEECH_TOKEN_RATE))
        if exact:
            embedding = campplus_ort.forward_ort_order(self.campplus, feats.unsqueeze(0)).reshape(1, -1)
        else:
            with torch.inference_mode():
                embedding = self.campplus(feats.unsqueeze(0)).float().reshape(1, -1)
        with _EMBEDDINGS_LOCK:
            _EMBEDDINGS[key] = embedding
            while len(_EMBEDDINGS) > EMBEDDINGS_KEPT:
                _EMBEDDINGS.popitem(last=False)
        return embedding.clone()

    def _campplus_identity(self) -> tuple:
        """Which CAM++ file this is (models sharing one campplus.onnx share their kept embeddings)."""
        self.campplus  # noqa: B018 -- a missing file is the loader's clear error, not a bare OSError
        path = (self.model_dir / CAMPPLUS).resolve()
        stat = path.stat()
        return str(path), stat.st_size, stat.st_mtime_ns

    def prompt_mel(self, audio: Audio) -> torch.Tensor:
        """[1, F, 80] Matcha mel of the audio at 24 kHz (upstream _extract_speech_feat)."""
        speech = self._load(audio, PROMPT_MEL_RATE)
        return matcha_mel(speech, self.mel_config).squeeze(0).transpose(0, 1).unsqueeze(0)

    def voice_prompt(self, audio: Audio, text: str | None, aligned: bool = True) -> dict[str, torch.Tensor]:
        """Everything a reference clip contributes (upstream frontend_zero_shot without the target text).

        `aligned=False` keeps every mel frame and token, as upstream's frontend_vc does.
        """
        feat = self.prompt_mel(audio)
        tokens = self.speech_tokens(audio)
        if self.variant.version >= 2 and aligned:
            # v2/v3 keep exactly two mel frames per prompt token
            n = min(feat.shape[1] // 2, tokens.shape[1])
            feat, tokens = feat[:, :2 * n], tokens[:, :n]
        embedding = self.speaker_embedding(audio)
        prompt = {"llm_prompt_speech_token": tokens, "flow_prompt_speech_token": tokens,
                  "prompt_speech_feat": feat, "llm_embedding": embedding, "flow_embedding": embedding}
        if text is not None:
            prompt["prompt_text"] = self.tokens(self.with_system_prompt(self.normalize(text)))
        return prompt

    # -- modes ---------------------------------------------------------------------------------
    def model_input(self, mode: str, text: Any, prompt: dict[str, torch.Tensor] | None = None,
                    instruct: str | None = None) -> dict[str, Any]:
        """Upstream's frontend_<mode> output for one text segment (tokens or a token iterator)."""
        if mode == "preset":
            return {"text": text, "llm_embedding": prompt["embedding"], "flow_embedding": prompt["embedding"]}
        if mode == "clone":
            if "prompt_text" not in prompt:
                raise InvalidRequest("this voice has no reference text: use mode 'cross_lingual'", field="reference")
            return {**prompt, "text": text}
        if mode == "cross_lingual":
            return {k: v for k, v in prompt.items() if k not in ("prompt_text", "llm_prompt_speech_token")} \
                | {"text": text}
        if mode == "instruct":
            instruct_tokens = self.tokens(self.instruct_prompt(instruct))
            if self.variant.instruct_mode == "instruct":
                # v1: a preset speaker's embedding for the flow only, the instruction as LM prompt
                return {"text": text, "flow_embedding": prompt["embedding"], "prompt_text": instruct_tokens}
            keep = {k: v for k, v in prompt.items() if k not in ("llm_prompt_speech_token", "prompt_text")}
            return keep | {"text": text, "prompt_text": instruct_tokens}
        raise InvalidRequest(f"mode {mode!r} has no text model input")

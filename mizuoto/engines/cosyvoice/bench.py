"""`mizuoto bench` for CosyVoice 2/3: a driver over the engine's own stage modules, and random models.

The driver loads a model directory's LM, flow and HiFT with the engine's loaders (no front
end: the request is made of token ids), and runs one fixed request: the settings' text with a
random 3-second voice prompt (75 speech tokens, their mel frames and an x-vector), the LM
generating exactly `tokens` speech tokens through `generate` with every stop id suppressed.
Streaming runs the engine's own `Synthesizer`, so the first chunk is cut where a request's is.

`build_random_cosyvoice2` writes a full-size CosyVoice 2 directory with random weights, in
upstream's checkpoint format: sizes come only from the real cosyvoice2.yaml and the Qwen
config.json in the shared assets, since no real weights can be downloaded here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Iterator

import torch

from mizuoto.engines.cosyvoice.flow import build_flow, load_flow_weights
from mizuoto.engines.cosyvoice.hift import build_hift, load_hift
from mizuoto.engines.cosyvoice.llm import ENDOFPROMPT_ID, QwenSpeechLM, build_lm, load_lm
from mizuoto.engines.cosyvoice.noise import cosyvoice3_noise
from mizuoto.engines.cosyvoice.synthesis import Synthesizer, schedule_for
from mizuoto.engines.cosyvoice.variants import find_variant, load_config
from mizuoto.errors import InvalidRequest
from mizuoto.runtime.graphs import use_cuda_graphs

BLANK_EN = "CosyVoice-BlankEN"
RANDOM_KINDS = ("cosyvoice2",)
PROMPT_TOKENS = 75  # a 3-second voice prompt at 25 tokens/s
_MARKER = "random-weights.json"
# weight-norm names in upstream's hift.pt (torch's parametrization)
_WN_G, _WN_V = ".parametrizations.weight.original0", ".parametrizations.weight.original1"


def assets_dir(assets: str | Path | None = None) -> Path:
    """The shared assets folder (`--assets`, else $MIZUOTO_ASSETS or the one beside the fixtures)."""
    if assets is not None:
        path = Path(assets)
    else:
        from mizuoto.testing.fixtures import assets_root
        try:
            path = assets_root()
        except FileNotFoundError as exc:
            raise InvalidRequest(f"bench --random: {exc} (or pass --assets DIR)") from None
    if not (path / "cosyvoice" / "CosyVoice2-0.5B" / "cosyvoice2.yaml").is_file():
        raise InvalidRequest(f"bench --random: {path} has no cosyvoice/CosyVoice2-0.5B/cosyvoice2.yaml")
    return path


def _hift_checkpoint(hift: torch.nn.Module) -> dict[str, torch.Tensor]:
    """HiFT weights as upstream stores them: weight-normed layers as (g, v), g = |v| per output row."""
    state = dict(hift.state_dict())
    for name in hift.weight_normed():
        v = state.pop(f"{name}.weight")
        state[name + _WN_G] = v.flatten(1).norm(dim=1).reshape((-1,) + (1,) * (v.dim() - 1))
        state[name + _WN_V] = v
    return state


def _copy(src: Path, dst: Path) -> None:
    # contents only: the shared assets are read-only, a rebuilt directory must stay writable
    dst.unlink(missing_ok=True)
    shutil.copyfile(src, dst)


def build_random_cosyvoice2(dest: str | Path, assets: str | Path | None = None, seed: int = 0) -> Path:
    """Write a full-size CosyVoice 2 model dir with random weights to `dest` (kept if already there)."""
    dest = Path(dest)
    marker = dest / _MARKER
    if marker.is_file() and json.loads(marker.read_text()).get("seed") == seed:
        return dest
    root = assets_dir(assets) / "cosyvoice"
    (dest / BLANK_EN).mkdir(parents=True, exist_ok=True)
    _copy(root / "CosyVoice2-0.5B" / "cosyvoice2.yaml", dest / "cosyvoice2.yaml")
    for f in (root / BLANK_EN).iterdir():  # Qwen config.json and the tokenizer files
        if f.is_file():
            _copy(f, dest / BLANK_EN / f.name)
    config = load_config(dest, find_variant(dest))
    torch.manual_seed(seed)
    lm = build_lm(config["llm"], dest)
    state = {lm.upstream_key(k): v for k, v in lm.state_dict().items()}
    if lm.llm.lm_head is None:  # tied, as in Qwen2.5-0.5B: upstream's file still names the head
        state["llm.model.lm_head.weight"] = state["llm.model.model.embed_tokens.weight"]
    torch.save(state, dest / "llm.pt")
    del lm, state
    torch.save(build_flow(config).state_dict(), dest / "flow.pt")
    torch.save(_hift_checkpoint(build_hift(config)), dest / "hift.pt")
    marker.write_text(json.dumps({"seed": seed, "from": str(root / "CosyVoice2-0.5B" / "cosyvoice2.yaml")}))
    return dest


def lm_step_bytes(lm: QwenSpeechLM, positions: float) -> int:
    """Bytes one decode step reads: the decoder layers, final norm, speech head and the KV cache."""
    dec = lm.llm
    size = lambda ps: sum(p.numel() * p.element_size() for p in ps)  # noqa: E731
    weights = size(p for n, p in dec.named_parameters() if not n.startswith(("embed_tokens", "lm_head")))
    weights += size(lm.llm_decoder.parameters())
    kv = dec.config.kv_bytes_per_position(dec.embed_tokens.weight.element_size(), repeated=False)
    return int(weights + kv * positions)


class CosyVoiceBench:
    """The bench driver of one CosyVoice 2/3 model directory (see mizuoto.runtime.bench.BenchDriver)."""

    def __init__(self, model_dir: Path, options: Any, settings: Any, label: str | None = None) -> None:
        variant = find_variant(model_dir)
        if variant is None or variant.version < 2:
            raise InvalidRequest(f"bench: {model_dir} is not a CosyVoice 2/3 model (CosyVoice 1 is not benchmarked)")
        self.options, self.settings = options, settings
        self.settings_tokens = settings.tokens  # what the LM stage generates (set per call)
        self.device = device = torch.device(options.device)
        config = load_config(model_dir, variant)
        self.sample_rate = int(config["sample_rate"])
        self.llm = load_lm(model_dir, config).to(device)
        self.flow_module = load_flow_weights(build_flow(config), model_dir / "flow.pt").eval().to(device)
        if options.compute.compile:
            self.flow_module.decoder.estimator.compile()
        noise = cosyvoice3_noise(config) if variant.version == 3 else None
        self.hift = load_hift(model_dir / "hift.pt", config, noise, device=device)
        self.version = variant.version
        kv = options.compute.kv_cache
        why = None if kv == "static" else "it needs compute.kv_cache=static"
        self.lm_options = {"cache": kv, "cuda_graphs": use_cuda_graphs(options.compute.cuda_graphs, device,
                                                                       "the LM", why)}
        decode = ("CUDA graphs" if self.lm_options["cuda_graphs"] else "on-device sampler") \
            if device.type == "cuda" else "upstream's loop"
        self.name = (f"cosyvoice{variant.version} ({label or model_dir.name}; {kv} KV cache, {decode}; "
                     f"{options.precision}{', compiled flow' if options.compute.compile else ''})")
        node = config["flow"]
        self.schedule = schedule_for(variant.version, int(node.get("input_frame_rate", 50)),
                                     int(node.get("token_mel_ratio", 1)), int(node.get("pre_lookahead_len", 0)),
                                     self.sample_rate)
        self.inputs = self._request(model_dir, config, int(node.get("token_mel_ratio", 1)))

    def _request(self, model_dir: Path, config: dict, mel_ratio: int) -> dict[str, torch.Tensor]:
        from mizuoto.text.tokenize import QwenTokenizer

        node = config.get("get_tokenizer")
        version = node.get("version", "cosyvoice2") if node is not None else "cosyvoice2"
        tok = QwenTokenizer.from_dir(model_dir / BLANK_EN, version=version)
        text = tok.encode(self.settings.text)
        if not text:
            raise InvalidRequest("bench: the request text is empty")
        prompt_text = tok.encode(self.settings.prompt_text)
        if self.version == 3 and ENDOFPROMPT_ID not in text + prompt_text:
            prompt_text.append(ENDOFPROMPT_ID)  # CosyVoice 3 needs it
        g = torch.Generator().manual_seed(2)
        speech = torch.randint(0, self.llm.speech_token_size, (1, PROMPT_TOKENS), generator=g, dtype=torch.int32)
        spk_dim = self.flow_module.spk_embed_affine_layer.in_features
        return {"text": torch.tensor([text], dtype=torch.int32),
                "prompt_text": torch.tensor([prompt_text], dtype=torch.int32).reshape(1, -1),
                "llm_prompt_speech_token": speech, "flow_prompt_speech_token": speech,
                "prompt_speech_feat": torch.randn(1, PROMPT_TOKENS * mel_ratio, self.flow_module.output_size,
                                                  generator=g),
                "llm_embedding": torch.randn(1, spk_dim, generator=g),
                "flow_embedding": torch.randn(1, spk_dim, generator=g)}

    def _autocast(self):
        # upstream's fp16: CUDA autocast around the LM and the flow
        return torch.autocast("cuda", dtype=torch.float16,
                              enabled=self.options.precision == "fp16" and self.device.type == "cuda")

    def _generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    # -- the engine's stages, as the Synthesizer calls them -------------------------------------
    def _lm_stage(self, text, prompt_text, prompt_speech_token, embedding, generator) -> Iterator[int]:
        tokens = self.settings_tokens
        d = self.device
        # max_len = int(len(text) * ratio) must be exactly `tokens`: aim at its middle
        ratio = (tokens + 0.5) / text.shape[1]
        it = self.llm.generate(text.to(d), prompt_text.to(d), prompt_speech_token.to(d), generator=generator,
                               max_token_text_ratio=ratio, min_token_text_ratio=0, suppress_stop=True,
                               **self.lm_options)
        while True:
            with self._autocast():
                token = next(it, None)
            if token is None:
                return
            yield token

    def _flow_stage(self, token, prompt_token, prompt_feat, embedding, *, streaming, finalize, cache, generator):
        d = self.device
        with self._autocast():
            mel = self.flow_module.inference(token.to(d), prompt_token.to(d), prompt_feat.to(d), embedding.to(d),
                                             streaming=streaming, finalize=finalize)
        return mel.float(), cache

    def _hift_stage(self, mel, *, cache_source, finalize, generator):
        if self.version == 3:
            return self.hift.inference(mel.to(self.device), finalize=finalize)
        return self.hift.inference(mel.to(self.device), cache_source.to(self.device), generator=generator)

    # -- BenchDriver ---------------------------------------------------------------------------
    def lm(self, tokens: int) -> list[int]:
        """Exactly `tokens` speech tokens for the request (stop ids suppressed)."""
        self.settings_tokens = tokens
        i = self.inputs
        out = list(self._lm_stage(i["text"], i["prompt_text"], i["llm_prompt_speech_token"], i["llm_embedding"],
                                  self._generator(0)))
        assert len(out) == tokens, (len(out), tokens)
        return out

    def lm_bytes_per_step(self, tokens: int) -> int:
        """Average bytes per decode step over a `tokens` run."""
        prompt = 2 + sum(self.inputs[k].shape[1] for k in ("text", "prompt_text", "llm_prompt_speech_token"))
        return lm_step_bytes(self.llm, prompt + tokens / 2)

    def flow(self, tokens: list[int]) -> torch.Tensor:
        """Tokens -> mel, in one piece (a non-streaming request's flow call)."""
        i = self.inputs
        mel, _ = self._flow_stage(torch.tensor([tokens], dtype=torch.int32), i["flow_prompt_speech_token"],
                                  i["prompt_speech_feat"], i["flow_embedding"], streaming=False, finalize=True,
                                  cache=None, generator=None)
        return mel

    def vocoder(self, mel: torch.Tensor) -> torch.Tensor:
        """Mel -> audio, in one piece."""
        speech, _ = self._hift_stage(mel, cache_source=torch.zeros(1, 1, 0), finalize=True,
                                     generator=self._generator(1))
        return speech

    def stream(self, tokens: int) -> Iterator[torch.Tensor]:
        """The request streamed by the engine's Synthesizer (its chunk schedule), audio chunks as they come."""
        self.settings_tokens = tokens
        synth = Synthesizer(self.schedule, self._lm_stage, self._flow_stage, self._hift_stage, None,
                            mel_bins=self.flow_module.output_size)
        yield from synth.run(self.inputs, stream=True, speed=1.0, lm_gen=self._generator(0),
                             voc_gen=self._generator(1))


def bench_driver(model_dir: Path | None, random: str | None, options: Any, settings: Any, workdir: Path,
                 assets: str | Path | None = None) -> CosyVoiceBench:
    """The factory `mizuoto bench` calls: a model dir, or `--random cosyvoice2` built under `workdir`."""
    if random is not None:
        if random not in RANDOM_KINDS:
            raise InvalidRequest(f"bench: cannot build a random {random!r} (known: {', '.join(RANDOM_KINDS)})")
        model_dir = build_random_cosyvoice2(Path(workdir) / f"random-{random}", assets)
        return CosyVoiceBench(model_dir, options, settings, label="random weights, full size")
    return CosyVoiceBench(Path(model_dir), options, settings)

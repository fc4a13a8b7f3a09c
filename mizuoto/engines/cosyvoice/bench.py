"""`mizuoto bench` for CosyVoice 1/2/3: the loaded model's own synthesizer on one fixed request, and random models.

The driver loads a model directory as a request would (CosyVoiceModel, its stages placed on the
device) and times the Synthesizer's own stage calls: `lm_tokens` (the LM's `generate`, with
every stop id suppressed so exactly `tokens` tokens come), `mel` (the flow's `token2mel`) and
`speech` (the vocoder's `vocode`), and `run` for a streamed request. The request is the
settings' text with a random 3-second voice prompt (75 speech tokens, their mel frames and an
x-vector); no front end runs, so a directory without the front end's ONNX files can be benched.

`build_random_cosyvoice2` writes a full-size CosyVoice 2 directory with random weights, in
upstream's checkpoint format: sizes come only from the real cosyvoice2.yaml and the Qwen
config.json of an assets folder (`--assets` or $MIZUOTO_ASSETS), since no real weights can be
downloaded here.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any, Iterator

import torch

from mizuoto.engines.cosyvoice.frontend import forget_embeddings
from mizuoto.engines.cosyvoice.flow import build_flow
from mizuoto.engines.cosyvoice.hift import build_hift
from mizuoto.engines.cosyvoice.noise import cosyvoice3_noise
from mizuoto.engines.cosyvoice.llm import ENDOFPROMPT_ID, QwenSpeechLM, TransformerSpeechLM, build_lm
from mizuoto.engines.cosyvoice.synthesis import Synthesizer
from mizuoto.engines.cosyvoice.variants import find_variant, load_config
from mizuoto.errors import InvalidRequest
from mizuoto.runtime.bench import measured_call, run_clients
from mizuoto.runtime.memory import tensor_bytes

BLANK_EN = "CosyVoice-BlankEN"
# kind -> the released yaml (under the assets' cosyvoice/) whose sizes a random model takes
RANDOM_KINDS = {"cosyvoice1": ("CosyVoice-300M", "cosyvoice.yaml"), "cosyvoice2": ("CosyVoice2-0.5B", "cosyvoice2.yaml"),
                "cosyvoice3": ("Fun-CosyVoice3-0.5B-2512", "cosyvoice3.yaml")}
PROMPT_TOKENS = 75  # a 3-second voice prompt at 25 tokens/s
_MARKER = "random-weights.json"
# weight-norm names in upstream's hift.pt (torch's parametrization)
_WN_G, _WN_V = ".parametrizations.weight.original0", ".parametrizations.weight.original1"


def assets_dir(assets: str | Path | None = None) -> Path:
    """The assets folder holding cosyvoice/CosyVoice2-0.5B/cosyvoice2.yaml (`--assets`, else $MIZUOTO_ASSETS)."""
    if assets is None and not os.environ.get("MIZUOTO_ASSETS"):
        raise InvalidRequest("bench --random: pass --assets DIR (or set $MIZUOTO_ASSETS): a folder with "
                             "cosyvoice/CosyVoice2-0.5B/cosyvoice2.yaml and cosyvoice/CosyVoice-BlankEN/")
    path = Path(assets if assets is not None else os.environ["MIZUOTO_ASSETS"])
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


def build_random_cosyvoice(kind: str, dest: str | Path, assets: str | Path | None = None, seed: int = 0) -> Path:
    """Write a full-size CosyVoice model dir of `kind` (RANDOM_KINDS) with random weights to `dest` (kept if there)."""
    folder, yaml_name = RANDOM_KINDS[kind]
    dest = Path(dest)
    marker = dest / _MARKER
    if marker.is_file():
        made = json.loads(marker.read_text())
        if made.get("seed") == seed and made.get("kind", "cosyvoice2") == kind:  # older markers: CosyVoice 2
            return dest
    root = assets_dir(assets) / "cosyvoice"
    dest.mkdir(parents=True, exist_ok=True)
    _copy(root / folder / yaml_name, dest / yaml_name)
    if kind != "cosyvoice1":  # the Qwen2 LMs read their config.json (and the tokenizer files) beside
        (dest / BLANK_EN).mkdir(exist_ok=True)
        for f in (root / BLANK_EN).iterdir():
            if f.is_file():
                _copy(f, dest / BLANK_EN / f.name)
    variant = find_variant(dest)
    config = load_config(dest, variant)
    torch.manual_seed(seed)
    lm = build_lm(config["llm"], dest)
    state = {lm.upstream_key(k): v for k, v in lm.state_dict().items()}
    if isinstance(lm, QwenSpeechLM) and lm.llm.lm_head is None:  # tied (Qwen2.5-0.5B): upstream's file names it
        state["llm.model.lm_head.weight"] = state["llm.model.model.embed_tokens.weight"]
    torch.save(state, dest / "llm.pt")
    del lm, state
    torch.save(build_flow(config).state_dict(), dest / "flow.pt")
    noise = cosyvoice3_noise(config) if variant.version == 3 else None
    torch.save(_hift_checkpoint(build_hift(config, noise)), dest / "hift.pt")
    marker.write_text(json.dumps({"seed": seed, "kind": kind, "from": str(root / folder / yaml_name)}))
    return dest


def build_random_cosyvoice2(dest: str | Path, assets: str | Path | None = None, seed: int = 0) -> Path:
    """Write a full-size CosyVoice 2 model dir with random weights to `dest` (kept if already there)."""
    return build_random_cosyvoice("cosyvoice2", dest, assets, seed)


def lm_step_bytes(lm: QwenSpeechLM | TransformerSpeechLM, positions: float) -> int:
    """Bytes one decode step reads: the decoder layers, final norm, speech head and the KV cache."""
    dec = lm.llm
    if isinstance(lm, TransformerSpeechLM):  # v1: the wenet encoder's blocks, K and V at its output size
        return int(tensor_bytes([dec, lm.llm_decoder]) + len(dec.encoders) * 2 * dec.output_size() * 4 * positions)
    weights = tensor_bytes([dec.layers, dec.norm, lm.llm_decoder])  # buffers too: a batch's packed layers
    kv = dec.config.kv_bytes_per_position(dec.embed_tokens.weight.element_size(), repeated=False)
    return int(weights + kv * positions)


class CosyVoiceBench:
    """The bench driver of one CosyVoice model directory (see mizuoto.runtime.bench.BenchDriver)."""

    def __init__(self, model: Any, settings: Any, label: str | None = None) -> None:
        variant, options = model.variant, model.options
        self.settings = settings
        self.device = device = torch.device(options.device)
        self.model = model
        model.batch_loop()  # a batching model's batch is made (its layers packed) before anything runs, as at a load
        for stage in self.model.stages:  # placed as a resident plan would: every movable module on the device
            for module in stage.movable().values():
                module.to(device)
        self.sample_rate = self.model.sample_rate
        graphs = self.model.synthesizer().lm_options.get("cuda_graphs", False)
        kv = options.compute.kv_cache
        decode = ("CUDA graphs" if graphs else "on-device sampler") if device.type == "cuda" else "upstream's loop"
        self.name = (f"cosyvoice{variant.version} ({label or model.model_dir.name}; {kv} KV cache, {decode}; "
                     f"{options.precision}{', compiled flow' if options.compute.compile else ''})")
        self.inputs = self._request()
        self.batch_width = model.batch_width
        self._batched = False

    def use_batch(self, on: bool) -> None:
        """Route `lm` and `stream` through the model's LM batch (the --concurrency sweep) or not."""
        self._batched = bool(on) and self.model.batch_loop() is not None

    def loop_seconds(self) -> dict[str, float]:
        """Where the model's batch loop spent its time so far, by kind of work (none without a batch)."""
        batch = self.model.batch_loop()
        return batch.timings() if batch is not None else {}

    def _request(self) -> dict[str, torch.Tensor]:
        model = self.model
        tok = model.frontend.tokenizer
        text = tok.encode(self.settings.text)
        if not text:
            raise InvalidRequest("bench: the request text is empty")
        prompt_text = tok.encode(self.settings.prompt_text)
        if model.variant.version == 3 and ENDOFPROMPT_ID not in text + prompt_text:
            prompt_text.append(ENDOFPROMPT_ID)  # CosyVoice 3 needs it
        g = torch.Generator().manual_seed(2)
        speech = torch.randint(0, model.llm.speech_token_size, (1, PROMPT_TOKENS), generator=g, dtype=torch.int32)
        spk_dim = model.flow.spk_embed_affine_layer.in_features
        mel_frames = model.schedule_mel_frames(PROMPT_TOKENS)
        return {"text": torch.tensor([text], dtype=torch.int32),
                "prompt_text": torch.tensor([prompt_text], dtype=torch.int32).reshape(1, -1),
                "llm_prompt_speech_token": speech, "flow_prompt_speech_token": speech,
                "prompt_speech_feat": torch.randn(1, mel_frames, model.flow.output_size, generator=g),
                "llm_embedding": torch.randn(1, spk_dim, generator=g),
                "flow_embedding": torch.randn(1, spk_dim, generator=g),
                "source_speech_token": torch.zeros(1, 0, dtype=torch.int32)}

    def synthesizer(self, tokens: int) -> Synthesizer:
        """The model's own synthesizer, its LM made to speak exactly `tokens` tokens (stop ids suppressed)."""
        # max_len = int(len(text) * ratio) must be exactly `tokens`: aim at its middle
        ratio = (tokens + 0.5) / self.inputs["text"].shape[1]
        # the single-request table times the unbatched path (upstream's loop; on a batching model over the
        # layers its batch packed at load), the sweep the batch
        return self.model.synthesizer(batched=self._batched, max_token_text_ratio=ratio, min_token_text_ratio=0,
                                      suppress_stop=True)

    def _generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    # -- BenchDriver ---------------------------------------------------------------------------
    def lm(self, tokens: int) -> list[int]:
        """Exactly `tokens` speech tokens for the request."""
        out = self.synthesizer(tokens).lm_call(self.inputs, self._generator(0))
        assert len(out) == tokens, (len(out), tokens)
        return out

    def lm_bytes_per_step(self, tokens: int) -> int:
        """Average bytes per decode step over a `tokens` run."""
        prompt = 2 + sum(self.inputs[k].shape[1] for k in ("text", "prompt_text", "llm_prompt_speech_token"))
        return lm_step_bytes(self.model.llm, prompt + tokens / 2)

    def flow(self, tokens: list[int]) -> torch.Tensor:
        """Tokens -> mel, in one piece (a non-streaming request's flow call)."""
        mel, _ = self.synthesizer(len(tokens)).mel(torch.tensor([tokens], dtype=torch.int32), self.inputs,
                                                   streaming=False, finalize=True, cache=None, generator=None)
        return mel

    def vocoder(self, mel: torch.Tensor) -> torch.Tensor:
        """Mel -> audio, in one piece."""
        speech, _ = self.synthesizer(1).speech(mel, cache_source=torch.zeros(1, 1, 0), finalize=True,
                                               generator=self._generator(1))
        return speech

    @property
    def reference_order(self) -> str:
        """How a reference clip's CAM++ runs (the load option compute.reference)."""
        return f"compute.reference={self.model.options.compute.reference}"

    def reference(self, clip: str, new: bool) -> None:
        """The clip's voice prompt (speech tokens, prompt mel, CAM++), its embedding not kept before if `new`."""
        if new:
            forget_embeddings()
        self.model.frontend.voice_prompt(clip, None)

    def stream(self, tokens: int) -> Iterator[torch.Tensor]:
        """The request streamed by the model's synthesizer (its chunk schedule), audio chunks as they come."""
        yield from self.synthesizer(tokens).run(self.inputs, stream=True, speed=1.0, lm_gen=self._generator(0),
                                                voc_gen=self._generator(1))

    # -- bench --memory ------------------------------------------------------------------------
    @property
    def tokens_per_second(self) -> float:
        """Speech tokens per second of audio (the flow's input rate)."""
        return float(self.model.flow.input_frame_rate)

    def memory_case(self, tokens: int, stream: bool, rows: int, served: bool = False) -> None:
        """One request of `tokens` speech tokens through the model's own stage calls, each inside `model.room`.

        Whole: the LM's generation (one call, its positions exactly what the LM fills: its length
        is capped at `tokens`), then one flow and one vocoder call; with `rows` > 1, that many
        requests' generations decoded together in the model's batch, as one call of `rows` rows.
        Streamed: the synthesizer's chunk schedule. `served`: `rows` whole requests in the batch,
        the k-th speaking k/rows of `tokens`, each submitting its flow and vocoder calls to the
        batch loop as soon as its LM is done (as a server's requests do).
        """
        if stream:
            for _ in self.stream(tokens):
                pass
            return
        if rows > 1 and self.model.batch_width < rows:
            raise InvalidRequest(f"bench --memory: {rows} rows need --option compute.batch={rows}")
        if served:
            lengths = iter([max(1, tokens * k // rows) for k in range(1, rows + 1)])
            lock = threading.Lock()

            def request() -> None:
                with lock:
                    n = next(lengths)
                self.vocoder(self.flow(self.lm(n)))
            self.use_batch(True)
            try:
                run_clients(rows, request)
            finally:
                self.use_batch(False)
            return
        if rows == 1:
            speech = self.lm(tokens)
        else:
            prompt = 3 + sum(self.inputs[k].shape[1] for k in ("text", "prompt_text", "llm_prompt_speech_token"))
            self.use_batch(True)
            try:
                with measured_call(self.model, "llm", positions=prompt + tokens, rows=rows, prefill=prompt):
                    speech = run_clients(rows, lambda: self.lm(tokens))[0][0]
            finally:
                self.use_batch(False)
        self.vocoder(self.flow(speech))


def bench_model_dir(model_dir: Path | None, random: str | None, workdir: Path,
                    assets: str | Path | None = None) -> tuple[Path, str | None]:
    """The directory `mizuoto bench` loads (a random kind is built under `workdir`) and its label."""
    if random is None:
        variant = find_variant(Path(model_dir))
        if variant is None:
            raise InvalidRequest(f"bench: {model_dir} is not a CosyVoice model directory")
        return Path(model_dir), None
    if random not in RANDOM_KINDS:
        raise InvalidRequest(f"bench: cannot build a random {random!r} (known: {', '.join(RANDOM_KINDS)})")
    return build_random_cosyvoice(random, Path(workdir) / f"random-{random}", assets), "random weights, full size"

"""A toy batched LM engine: the smallest engine on contract v2 whose sequence stage the runtime batches.

A tiny random-weight Qwen2-style `Decoder` turns the text's characters into token ids, drawn one at
a time, and each token becomes a short tone. The engine only says what is computed: the "text"
and "render" stages' work as `self.compute(stage, fn, **sizes)`, the "lm" stage's token loop as
`self.decode("lm", loop)` over the `Sequence` its stage declares. The runtime decides how: one
request at a time (`compute.batch=1`), or up to `compute.batch` requests sharing each one-token
step in the model's continuous batch, with the same loop code either way.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Sequence as Seq
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from mizuoto.errors import InvalidRequest, ModelLoadError
from mizuoto.nn.lm.decoder import Decoder, DecoderConfig
from mizuoto.runtime.engine import AudioChunk, Capabilities, Engine, Model, Stage, SynthesisRequest, Voice
from mizuoto.runtime.options import LoadOptions
from mizuoto.runtime.sequence import Sequence

CONFIG = "toylm.json"
WEIGHTS = "model.safetensors"
END, START = 0, 1  # special ids: the LM stops at END; START opens the prompt and marks where speech begins
TEXT_BASE = 2  # text characters map to ids from here on
MIN_TOKENS = 2  # END is masked before this many tokens: every request says something
NOTE_SECONDS = 0.05
CHUNK_TOKENS = 4  # tokens per streamed chunk
_PLANNING_CHARS = 200  # the working-memory bound when no request is given
_SLOWEST = 0.25  # the lowest speed a request may ask for (SPEED_RANGE), for the render stage's bound


def write_model(model_dir: str | Path, *, hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                vocab: int = 64, max_tokens: int = 40, sample_rate: int = 16000,
                voices: dict[str, float] | None = None, seed: int = 0) -> Path:
    """Create a toy LM model directory (config + random safetensors weights) and return it."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    # the decoder's section is a transformers config, read back by DecoderConfig.from_dict as a real one would be;
    # an untied head: tied random embeddings would make every token's likeliest successor itself
    decoder = {"model_type": "qwen2", "hidden_size": hidden, "intermediate_size": 2 * hidden,
               "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
               "vocab_size": vocab, "tie_word_embeddings": False}
    config = {"engine": "toylm", "sample_rate": sample_rate, "max_tokens": max_tokens, "decoder": decoder,
              "voices": voices or {"low": 220.0, "high": 440.0}}
    (model_dir / CONFIG).write_text(json.dumps(config, indent=1))
    with torch.random.fork_rng(devices=[]):  # the caller's global RNG state is left as it was
        torch.manual_seed(seed)
        modules = _build(config)
    save_file({k: v.contiguous() for k, v in modules.state_dict().items()}, str(model_dir / WEIGHTS))
    return model_dir


def _build(config: dict) -> torch.nn.ModuleDict:
    """The decoder and the render stage's timbre table (amplitude and brightness per token) from a config."""
    cfg = DecoderConfig.from_dict(config["decoder"], CONFIG)
    return torch.nn.ModuleDict({"decoder": Decoder(cfg), "timbre": torch.nn.Embedding(cfg.vocab_size, 2)})


class Draw:
    """The sampler: one id drawn from the softmax of the scores with the request's generator."""

    # On CUDA the runtime may swap a sampler for its on-device form (`FastSampler.like`), chosen by `kind`:
    # "random_sampling" is this very draw; without a kind it would draw as upstream CosyVoice's ras sampler.
    kind = "random_sampling"

    def __call__(self, scores: torch.Tensor, decoded: Seq[int], generator: torch.Generator | None) -> int:
        """One token id from 1-D log-probabilities."""
        return int(torch.multinomial(scores.softmax(dim=-1), 1, replacement=True, generator=generator).item())


class ToyLMModel(Model):
    """A loaded toy LM: stages "text" (frontend), "lm" (sequence, batched above width 1), "render" (frames)."""

    def __init__(self, config: dict, modules: torch.nn.ModuleDict, options: LoadOptions):
        self.rate = int(config["sample_rate"])
        self.max_tokens = int(config["max_tokens"])
        self._presets = {k: float(v) for k, v in config["voices"].items()}
        self.decoder: Decoder = modules["decoder"]
        self.timbre: torch.nn.Embedding = modules["timbre"]
        self.kv_cache = options.compute.kv_cache  # resolved: static when batched (rows sized once), else dynamic
        # above 1 the runtime runs the "lm" sequence in its continuous batch (Model.batch_loop); nothing else changes
        self.batch_width = options.compute.batch
        sequence = Sequence(decoder=self.decoder, head=self._head, sampler=Draw(), what="the toy LM",
                            cuda_graphs=options.compute.cuda_graphs,
                            # built on the host and placed later: packed layers only pay off where they stay
                            pack=torch.device(options.device).type == "cpu")
        self.stages = (
            # text -> ids is a lookup: no weights, but its call still runs where the model computes
            Stage("text", "frontend", {}),
            Stage("lm", "sequence", {"decoder": self.decoder}, memory=self._lm_memory, sequence=sequence),
            Stage("render", "frames", {"timbre": self.timbre}, memory=self._render_memory,
                  call_memory=self._render_call_memory),
        )
        self.capabilities = Capabilities(modes=frozenset({"preset"}), sample_rate=self.rate, stream_out=True,
                                         languages=("any",))

    def voices(self) -> list[Voice]:
        """The preset voices (a pitch each)."""
        return [Voice(k, "preset", f"{v:g} Hz") for k, v in self._presets.items()]

    # -- memory ---------------------------------------------------------------------------------
    def _lm_memory(self, request: SynthesisRequest | None) -> int:
        # the KV cache of the request's positions: its prompt and the most tokens it may draw
        chars = len(request.text) if request is not None and isinstance(request.text, str) else _PLANNING_CHARS
        return self.decoder.config.kv_bytes_per_position() * (chars + 2 + self._limit(chars))

    def _render_memory(self, request: SynthesisRequest | None) -> int:
        # each render call reserves its own tokens (Model.compute's sizes); every request renders one at least
        speed = request.speed if request is not None else _SLOWEST
        return self._render_call_memory(notes=1, samples=int(NOTE_SECONDS * self.rate / speed))

    @staticmethod
    def _render_call_memory(notes: int, samples: int) -> int:
        """A render call: one float64 wave of `samples` per note, and its float32 copy."""
        return 12 * notes * samples

    # -- the stages' work -----------------------------------------------------------------------
    def _limit(self, chars: int) -> int:
        """The most tokens a prompt of `chars` characters may draw (about one note a character)."""
        return min(self.max_tokens, MIN_TOKENS + chars)

    def _ids(self, text: str) -> list[int]:
        """The prompt's ids: START, one id per non-space character, START again (speech begins)."""
        chars = [TEXT_BASE + ord(ch) % (self.decoder.config.vocab_size - TEXT_BASE) for ch in text if not ch.isspace()]
        if not chars:
            raise InvalidRequest("text has nothing to say (only spaces)", field="text")
        return [START, *chars, START]

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Log-probabilities of the next id at the last position of normed hidden states (R, T, H): (V,) or (R, V)."""
        return self.decoder.logits(hidden[:, -1]).log_softmax(dim=-1).squeeze(0)

    def _loop(self, ids: list[int], seed: int) -> Callable[[Any], Iterator[int]]:
        """The request's token loop, `loop(steps)`: the same code alone and as a row of the batch."""
        decoder, embed, limit = self.decoder, self.decoder.embed_tokens, self._limit(len(ids) - 2)

        @torch.inference_mode()
        def loop(steps: Any) -> Iterator[int]:
            # the prompt is embedded where the passes run (alone: here; batched: on the batch's thread)
            x = steps.compute(lambda: embed(torch.tensor([ids], device=embed.weight.device)))
            # a static cache is sized once: the prompt and the most tokens this request may draw
            steps.attach(lambda: decoder.new_cache(self.kv_cache, len(ids) + limit))
            decoded: list[int] = []
            generator = None
            while len(decoded) < limit:
                scores = yield from steps.scores(x)
                if len(decoded) < MIN_TOKENS:
                    scores[END] = -math.inf
                if generator is None:  # made where the scores are: a CPU generator cannot draw on CUDA
                    generator = torch.Generator(scores.device).manual_seed(seed)
                token = steps.draw(scores, decoded, generator)
                if token == END:
                    return
                yield token
                decoded.append(token)
                x = embed.weight[token].reshape(1, 1, -1)  # the drawn token is the next input
        return loop

    def _render(self, tokens: list[int], f0: float, speed: float, phase: float,
                urgent: bool = False) -> tuple[torch.Tensor, float]:
        """A tone per token continuing from `phase`, as one reserved "render" call; the audio and its end phase."""
        n = int(NOTE_SECONDS * self.rate / speed)

        def run(device: torch.device) -> tuple[torch.Tensor, float]:
            timbre = torch.tanh(self.timbre(torch.tensor(tokens, device=device))).double().cpu()
            t = torch.arange(n, dtype=torch.float64)
            edge = torch.linspace(0.0, 1.0, min(32, n // 2), dtype=torch.float64)  # fade in: no click
            out, p = [], phase
            for token, (gain, bright) in zip(tokens, timbre.tolist()):
                freq = f0 * 2.0 ** ((token % 12) / 12)
                arg = p + 2 * math.pi * freq * t / self.rate
                wave = (torch.sin(arg) + 0.3 * (bright + 1) * torch.sin(2 * arg)) * (0.15 + 0.05 * gain)
                wave[:edge.numel()] *= edge
                out.append(wave.float())
                p = (p + 2 * math.pi * freq * n / self.rate) % (2 * math.pi)
            return torch.cat(out), p
        return self.compute("render", run, urgent=urgent, notes=len(tokens), samples=n)

    def synthesize(self, request: SynthesisRequest) -> Iterator[AudioChunk]:
        """Text to ids, ids to tokens (the LM), tokens to tones: one chunk, or one every CHUNK_TOKENS tokens."""
        f0 = self._presets[request.voice]
        seed = request.seed if request.seed is not None else int(torch.randint(0, 2**31, (1,)))
        ids = self.compute("text", lambda device: self._ids(request.text))
        tokens = self.decode("lm", self._loop(ids, seed))
        if not request.stream:
            audio, _ = self._render(list(tokens), f0, request.speed, 0.0)
            yield AudioChunk(audio, self.rate, 0, True)
            return
        # chunks are held back by one so that the last can carry final=True
        phase, index, pending, ready = 0.0, 0, [], None
        for token in tokens:
            pending.append(token)
            if len(pending) == CHUNK_TOKENS:
                if ready is not None:
                    yield AudioChunk(ready, self.rate, index, False)
                    index += 1
                # the first audio is urgent: a batch loop runs it ahead of its other calls
                ready, phase = self._render(pending, f0, request.speed, phase, urgent=ready is None)
                pending = []
        if pending:
            if ready is not None:
                yield AudioChunk(ready, self.rate, index, False)
                index += 1
            ready, phase = self._render(pending, f0, request.speed, phase, urgent=ready is None)
        yield AudioChunk(ready, self.rate, index, True)


class ToyLMEngine(Engine):
    """Tones from a tiny random LM; see mizuoto.testing.toy_lm."""

    name = "toylm"
    description = "toy batched LM engine (engine contract v2 example; tests and demos; not speech)"
    capabilities = Capabilities(modes=frozenset({"preset"}), sample_rate=16000, stream_out=True)

    def detect(self, model_dir: Path) -> bool | str:
        """Whether the directory holds a toylm config."""
        try:
            return json.loads((Path(model_dir) / CONFIG).read_text()).get("engine") == "toylm"
        except (OSError, ValueError, AttributeError):
            return False

    def load(self, model_dir: Path, options: LoadOptions | None) -> ToyLMModel:
        """The model from its config and weights, modules on the host (the runtime places them)."""
        options = (options if options is not None else LoadOptions()).resolved()
        try:
            config = json.loads((Path(model_dir) / CONFIG).read_text())
            modules = _build(config)
            modules.load_state_dict(load_file(str(Path(model_dir) / WEIGHTS)))
        except Exception as e:  # missing, truncated or foreign files all mean the same to a user
            raise ModelLoadError(f"cannot load toylm model {model_dir}: {e}") from e
        return ToyLMModel(config, modules, options)

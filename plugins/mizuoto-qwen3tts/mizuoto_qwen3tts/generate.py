"""The frame loop: the talker draws codebook 0 of each frame, the code predictor codebooks 1..groups-1.

Upstream (`qwen-tts` 0.1.1) runs transformers' `generate` over the talker and, inside each talker
forward after the prefill, a second `generate` over the code predictor. Written out, per frame:

1. the talker's scores at its last position go through transformers' processors in their order:
   repetition penalty over the talker's own tokens so far, the stop code held back for the first
   two tokens (min length and min new tokens), the last 1024 ids of the talker's vocabulary (its
   control, language and speaker ids) suppressed except the stop code; when sampling, temperature
   (unless 1), top-k (unless 0), top-p (when < 1), softmax and one `torch.multinomial` draw, else
   the argmax. A stop code, or `max_new_tokens` tokens, ends the loop: so N tokens give N - 1 frames.
2. the code predictor reads [the talker's last hidden state, codebook 0 embedded by the talker's
   table] and then each code it drew (codebook i by its table i - 1), on a KV cache of its own made
   per frame, and draws codebooks 1..groups-1 with temperature / top-k / top-p only (or argmax);
3. the frame's group embeddings summed, plus the next trailing text row (the pad row once those are
   used up), are the talker's next input.

Every draw comes from one generator (None: torch's default one, upstream's), in upstream's order:
talker token 0, codebooks 1..15 of frame 0, talker token 1, and so on. The loop is written on the
runtime's token-loop contract (`mizuoto.runtime.sequence`): the talker's passes go through
`steps.scores`, the code predictor's 15 passes run in `steps.compute`, where the passes run.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from mizuoto.errors import InvalidRequest, ModelLoadError
from mizuoto.nn.lm import logits as lp
from mizuoto.nn.lm.kv_cache import KVCache, StaticKVCache
from mizuoto.runtime.sequence import AloneSteps, Sequence
from mizuoto_qwen3tts.code_predictor import CodePredictor
from mizuoto_qwen3tts.ids import ModelIds
from mizuoto_qwen3tts.prefill import Prefill
from mizuoto_qwen3tts.talker import Talker

GENERATION_CONFIG = "generation_config.json"
MIN_NEW_TOKENS = 2  # upstream's generate asks the talker for at least two tokens before a stop
SUPPRESSED_TAIL = 1024  # upstream suppresses the talker vocabulary's last 1024 ids, but for the stop code


@dataclass(frozen=True)
class SamplingOptions:
    """A request's sampling settings: the call's values over `generation_config.json`'s over upstream's defaults.

    The talker samples with `do_sample`, `top_k`, `top_p`, `temperature`, `repetition_penalty`;
    the code predictor with the `subtalker_*` four (no repetition penalty). `max_new_tokens` caps
    the talker's tokens (frames: one fewer).
    """

    do_sample: bool = True
    top_k: int = 50
    top_p: float = 1.0
    temperature: float = 0.9
    repetition_penalty: float = 1.05
    subtalker_dosample: bool = True
    subtalker_top_k: int = 50
    subtalker_top_p: float = 1.0
    subtalker_temperature: float = 0.9
    max_new_tokens: int = 2048

    @classmethod
    def from_model_dir(cls, model_dir: str | Path | None = None, **overrides: Any) -> "SamplingOptions":
        """Upstream's defaults, then the model dir's `generation_config.json` (when there is one), then `overrides`
        (None: not given); an unknown name or a value transformers refuses is an InvalidRequest."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise InvalidRequest(f"unknown sampling option(s) {unknown}; known: {sorted(names)}", field="options")
        values: dict[str, Any] = {}
        path = Path(model_dir) / GENERATION_CONFIG if model_dir is not None else None
        if path is not None and path.is_file():
            try:
                config = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError) as exc:
                raise ModelLoadError(f"cannot read {path}: {exc}") from None
            values.update({k: v for k, v in config.items() if k in names})  # its other keys upstream ignores too
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values).checked()

    def checked(self) -> "SamplingOptions":
        """These options, after the checks transformers makes when it builds its processors (InvalidRequest)."""
        def need(ok: bool, name: str, what: str) -> None:
            if not ok:
                raise InvalidRequest(f"{name} must be {what}, not {getattr(self, name)!r}", field="options")
        need(isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1, "max_new_tokens", "an int >= 1")
        need(self.repetition_penalty > 0, "repetition_penalty", "> 0")
        for prefix in ("", "subtalker_"):
            if getattr(self, "subtalker_dosample" if prefix else "do_sample"):
                need(getattr(self, prefix + "temperature") > 0, prefix + "temperature", "> 0 when sampling")
                need(isinstance(getattr(self, prefix + "top_k"), int) and getattr(self, prefix + "top_k") >= 0,
                     prefix + "top_k", "an int >= 0 (0: no top-k)")
                need(0.0 <= getattr(self, prefix + "top_p") <= 1.0, prefix + "top_p", "within [0, 1]")
        return self


def warp(scores: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """transformers' sampling warpers in their order: temperature (unless 1), top-k (unless 0), top-p (when < 1)."""
    if temperature != 1.0:
        scores = lp.temperature(scores, temperature)
    if top_k != 0:
        scores = lp.top_k(scores, max(top_k, 1))
    if top_p < 1.0:
        scores = lp.top_p(scores, top_p)
    return scores


def draw(scores: torch.Tensor, sample: bool, generator: torch.Generator | None) -> int:
    """transformers' pick from processed scores (1, V): one multinomial draw from their softmax, or the argmax."""
    if not sample:
        return int(torch.argmax(scores, dim=-1))
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


class FrameLoop:
    """One model's talker and code predictor, and the loop that turns a `Prefill` into frames of codes."""

    def __init__(self, talker: Talker, predictor: CodePredictor, ids: ModelIds) -> None:
        self.talker, self.predictor, self.ids = talker, predictor, ids
        self.vocab = talker.head.out_features
        if self.vocab != ids.vocab_size or len(predictor.tables) != ids.groups - 1:
            raise ModelLoadError(f"the talker has {self.vocab} codes and the predictor {len(predictor.tables) + 1} "
                                 f"groups; the config says {ids.vocab_size} and {ids.groups}")
        self._stop = torch.tensor([ids.codec_eos])
        self._suppressed = torch.tensor([i for i in range(self.vocab - SUPPRESSED_TAIL, self.vocab)
                                         if i != ids.codec_eos])

    # -- the talker as the runtime's sequence ------------------------------------------------------------
    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The codec head's logits at the last position and that position's hidden state, one row: (R, V + H).

        The runtime's steps hand a loop what the head returns and nothing else, but the code
        predictor reads the talker's last (normed) hidden state as well, so both travel as one
        tensor, split again in the loop. The head runs over every position, as upstream's does
        (the matrix product's rounding depends on its shape), and the last one is kept.
        """
        return torch.cat([self.talker.head(hidden)[:, -1], hidden[:, -1]], dim=-1)

    def batch_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """`head` for a batch's rows (B, T, H): (V + H,) for B = 1, (B, V + H) else."""
        scores = self.head(hidden)
        return scores[0] if scores.shape[0] == 1 else scores

    def sequence(self, **declared: Any) -> Sequence:
        """What the runtime runs the talker's loop over (`mizuoto.runtime.sequence`): the talker's decoder, `head`."""
        return Sequence(decoder=self.talker.decoder, head=self.head, row_head=self.batch_head, rows=1, stacked=True,
                        what="the Qwen3-TTS talker", **declared)

    def _attach(self, steps: Any | None, prefill: Prefill, most: int, static: bool | None) -> Any:
        """The runtime's steps (alone when None) over the talker's cache for the prompt and `most` more positions.

        Alone, a static cache (preallocated for every position, which CUDA graphs need) where the
        talker runs on CUDA or `static` asks for it, else a growing one (upstream's kind; a static
        one for the default 8192 tokens of a released model would take GBs up front). Both give
        the same numbers on the CPU (tests/test_generate.py).
        """
        steps = steps if steps is not None else AloneSteps(self.sequence())
        decoder = self.talker.decoder
        if static is None:
            static = self.talker.head.weight.device.type == "cuda"

        def alone() -> KVCache:
            if not static:
                return decoder.new_cache()
            cfg = decoder.config
            return StaticKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                                 prefill.inputs_embeds.shape[1] + most)
        return steps.attach(alone, row=decoder.new_cache)

    # -- the loop ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prefill: Prefill, options: SamplingOptions, generator: torch.Generator | None = None,
                 steps: Any | None = None, on_token: Callable[[int, torch.Tensor], None] | None = None,
                 static_cache: bool | None = None, ban_stop: bool = False) -> Iterator[torch.Tensor]:
        """Each completed frame's codes, a LongTensor (groups,), as soon as it is drawn.

        `generator`: where every draw comes from (None: torch's default generator, as upstream);
        `steps`: the runtime's when it runs this loop (`Model.decode`; None: by itself here);
        `on_token(token, hidden)`: told each talker token and the hidden state (H,) it was drawn
        from, the last token too (the stop code, or one whose frame was never completed). The
        generator's return value says whether the stop code ended it. `static_cache`: the talker's
        cache when it runs alone (None: static on CUDA only; see `_attach`). `ban_stop`: the stop code
        is never drawn, so exactly `max_new_tokens` tokens come (benchmarks only: `mizuoto bench`).
        """
        steps = self._attach(steps, prefill, options.max_new_tokens, static_cache)
        forward = steps.scores
        scores = yield from forward(prefill.inputs_embeds)
        drawn: list[int] = []
        for step in range(options.max_new_tokens):
            logits, hidden = scores[:, :self.vocab].clone(), scores[:, self.vocab:].clone()
            token = draw(self._talker_scores(logits, drawn, options, ban_stop), options.do_sample, generator)
            drawn.append(token)
            if on_token is not None:
                on_token(token, hidden[0])
            if token == self.ids.codec_eos:
                return True
            if len(drawn) == options.max_new_tokens:  # transformers stops before the forward that would use it
                return False
            codes, x = steps.compute(lambda: self._frame(hidden, token, step, prefill, options, generator))
            yield codes
            scores = yield from forward(x)
        return False

    def _talker_scores(self, logits: torch.Tensor, drawn: list[int], o: SamplingOptions,
                       ban_stop: bool = False) -> torch.Tensor:
        """transformers' processors over the talker's logits (1, V), in the order its generate builds them."""
        scores = logits
        if o.repetition_penalty != 1.0:  # over the talker's own tokens: its generate starts from no ids
            scores = lp.repetition_penalty(torch.tensor(drawn, dtype=torch.int64, device=scores.device).reshape(1, -1),
                                           scores,
                                           float(o.repetition_penalty))
        if len(drawn) < MIN_NEW_TOKENS or ban_stop:  # ban_stop: before the warpers, which keep the likeliest others
            # transformers' min-length and min-new-tokens processors both hold the stop code back here;
            # the second mask changes nothing the first did not
            scores = lp.suppress(scores, self._stop)
        scores = lp.suppress(scores, self._suppressed)
        if o.do_sample:
            scores = warp(scores, o.temperature, o.top_k, o.top_p)
        return scores

    def _frame(self, hidden: torch.Tensor, token: int, step: int, prefill: Prefill, o: SamplingOptions,
               generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Codebooks 1.. of the frame whose codebook 0 is `token`, and the talker's next input (1, 1, H)."""
        predictor, device = self.predictor, hidden.device
        first = self.talker.codec(torch.tensor([[token]], dtype=torch.int64, device=device))
        x = torch.cat((hidden.reshape(1, 1, -1), first), dim=1)
        cache = predictor.decoder.new_cache()
        codes = [token]
        for book in range(1, self.ids.groups):
            logits = predictor.logits(x, cache, book)[:, -1, :].clone()
            if o.subtalker_dosample:
                logits = warp(logits, o.subtalker_temperature, o.subtalker_top_k, o.subtalker_top_p)
            codes.append(draw(logits, o.subtalker_dosample, generator))
            if book + 1 < self.ids.groups:  # the last code is drawn with no forward after it
                x = predictor.tables[book - 1](torch.tensor([[codes[-1]]], dtype=torch.int64, device=device))
        drawn = torch.tensor([codes[1:]], dtype=torch.int64, device=device)
        rows = [first] + [predictor.tables[i](drawn[..., i:i + 1]) for i in range(self.ids.groups - 1)]
        x = torch.cat(rows, dim=1).sum(1, keepdim=True)
        if step < prefill.trailing.shape[1]:
            x = x + prefill.trailing[:, step].unsqueeze(1)
        else:
            x = x + prefill.pad
        return torch.tensor(codes, dtype=torch.int64), x

"""Chatterbox's T3: text tokens and a voice's conditioning to speech tokens, on `mizuoto.nn.lm.decoder`.

T3 runs a decoder-only LM over [conditioning, text, speech] embeddings of its own (its backbone's
token table is unused): the English model a Llama (llama3 RoPE) with learned text and speech
position tables, a Perceiver over the prompt's speech tokens and an "exaggeration" input, sampled
with classifier-free guidance (a cond row and an uncond row whose text embeddings are zero); Turbo a
GPT-2 without any of those, sampled from one row. Both compute what upstream's `T3.inference` /
`T3.inference_turbo` (chatterbox-tts 0.1.7 on transformers 5.2.0) compute, draw for draw:

- English: the prompt is [cond, text + text positions, start + speech position 0] and then the start
  token's embedding *again* (upstream appends it after building the prompt); a step feeds
  speech_emb(token) + speech position i + 1 to both rows; logits = cond + cfg * (cond - uncond), then
  repetition penalty over the tokens so far (the start token first), temperature (unless 1),
  min-p, top-p, softmax, one multinomial draw; the stop token ends it (and is returned).
- Turbo: the prompt is [cond, text, start]; processors temperature (unless 0 or 1), top-k (if > 0),
  top-p (if < 1), repetition penalty (if not 1), in that order, over the tokens so far (the start
  token alone at the first draw); a draw after which every score is -inf ends it; the stop token is
  dropped from what is returned.

Upstream's cond and uncond rows go through one SDPA call each layer; SDPA on the CPU rounds a batch
of two otherwise than two calls of one, so the pair stays one batch of two here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from mizuoto.errors import InvalidRequest
from mizuoto.nn.lm import logits as lp
from mizuoto.nn.lm.decoder import Decoder, DecoderConfig
from mizuoto.nn.lm.kv_cache import StaticKVCache
from mizuoto.runtime.convert.checkpoint import DictSource, match_state_dict
from mizuoto.runtime.sequence import AloneSteps, Sequence as SequenceSpec
from mizuoto_chatterbox.weights import count_children, read_weights, reduced_config

START_TEXT, STOP_TEXT = 255, 0  # the English text table's start and stop ids
START_SPEECH, STOP_SPEECH = 6561, 6562
SPEAKER_SIZE = 256  # the voice encoder's embedding
MAX_NEW_TOKENS = 1000  # English generate's cap
TURBO_MAX_NEW_TOKENS = 1000  # inference_turbo's max_gen_len (a first draw, then up to this many)
# Head counts are not in the weights: upstream's configs fix them (a `reduced_config.json` beside
# reduced test weights states its own)
# (T3 reads its own speech head: the backbone gets no output head of its own, hence "tied")
LLAMA = {"model_type": "llama", "tie_word_embeddings": True, "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
         "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                          "original_max_position_embeddings": 8192}}
GPT2_HEADS = 16
PERCEIVER_HEADS = 4


@dataclass(frozen=True)
class T3Options:
    """Upstream's per-request generation settings (English defaults; Turbo ignores cfg_weight, min_p, exaggeration)."""

    temperature: float = 0.8
    top_p: float = 1.0
    min_p: float = 0.05
    top_k: int = 1000
    repetition_penalty: float = 1.2
    cfg_weight: float = 0.5


class PerceiverBlock(nn.Module):
    """Upstream's AttentionBlock2: x1 attends to x2 (both LayerNormed), SDPA at its default scale, a residual."""

    def __init__(self, channels: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(channels)
        self.to_q, self.to_k, self.to_v = (nn.Linear(channels, channels) for _ in range(3))
        self.proj_out = nn.Linear(channels, channels)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        return x.view(b, n, self.heads, c // self.heads).permute(0, 2, 1, 3)

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        n1, n2 = self.norm(x1), self.norm(x2)
        q, k, v = self._split(self.to_q(n1)), self._split(self.to_k(n2)), self._split(self.to_v(n2))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0)
        b, _, n, _ = out.shape
        return x1 + self.proj_out(out.permute(0, 2, 1, 3).contiguous().view(b, n, -1))


class Perceiver(nn.Module):
    """A fixed set of learned queries read the prompt (cross-attention), then themselves, with one shared block."""

    def __init__(self, queries: int, channels: int, heads: int) -> None:
        super().__init__()
        self.pre_attention_query = nn.Parameter(torch.zeros(1, queries, channels))
        self.attn = PerceiverBlock(channels, heads)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        pre = self.attn(self.pre_attention_query.expand(h.shape[0], -1, -1), h)
        return self.attn(pre, pre)


class CondEncoder(nn.Module):
    """T3CondEnc: [speaker projection, prompt (through the Perceiver if any), exaggeration projection (if any)]."""

    def __init__(self, channels: int, perceiver: Perceiver | None, emotion: bool) -> None:
        super().__init__()
        self.spkr_enc = nn.Linear(SPEAKER_SIZE, channels)
        self.emotion_adv_fc = nn.Linear(1, channels, bias=False) if emotion else None
        self.perceiver = perceiver

    def forward(self, speaker: torch.Tensor, prompt: torch.Tensor, exaggeration: torch.Tensor) -> torch.Tensor:
        rows = [self.spkr_enc(speaker.view(-1, SPEAKER_SIZE))[:, None]]
        rows.append(self.perceiver(prompt) if self.perceiver is not None else prompt)
        if self.emotion_adv_fc is not None:
            rows.append(self.emotion_adv_fc(exaggeration.view(-1, 1, 1)))
        return torch.cat(rows, dim=1)


class T3(nn.Module):
    """The English T3 (`turbo` False) or Turbo's; parameter names are upstream's but for the backbone's."""

    def __init__(self, backbone: DecoderConfig, text_vocab: int, speech_vocab: int, perceiver: Perceiver | None,
                 text_positions: int = 0, speech_positions: int = 0) -> None:
        super().__init__()
        d = backbone.hidden_size
        self.turbo = backbone.learned_positions
        self.tfmr = Decoder(backbone)
        self.cond_enc = CondEncoder(d, perceiver, emotion=not self.turbo)
        self.text_emb = nn.Embedding(text_vocab, d)
        self.speech_emb = nn.Embedding(speech_vocab, d)
        self.text_pos_emb = nn.Embedding(text_positions, d) if text_positions else None
        self.speech_pos_emb = nn.Embedding(speech_positions, d) if speech_positions else None
        self.text_head = nn.Linear(d, text_vocab, bias=False)  # training only; kept to load every key
        self.speech_head = nn.Linear(d, speech_vocab, bias=self.turbo)

    # -- conditioning ---------------------------------------------------------------------------
    def conditioning(self, speaker: torch.Tensor, prompt_tokens: torch.Tensor,
                     exaggeration: torch.Tensor | float) -> torch.Tensor:
        """The rows ahead of the text (1, C, D): upstream's `prepare_conditioning`."""
        prompt = self.speech_emb(prompt_tokens)
        if self.speech_pos_emb is not None:
            prompt = prompt + self.speech_pos_emb(torch.arange(prompt_tokens.shape[1]))
        exaggeration = torch.as_tensor(exaggeration, dtype=torch.float32).reshape(1, 1, 1)
        return self.cond_enc(speaker, prompt, exaggeration)

    def _speech_position(self, i: int) -> torch.Tensor:
        return self.speech_pos_emb(torch.tensor([[i]]))

    # -- the backbone's passes ---------------------------------------------------------------------
    def sequence(self, **declared: Any) -> SequenceSpec:
        """What the runtime runs T3's token loops over (runtime.sequence).

        Alone, a request's rows (English: cond and uncond; Turbo: one) go through the backbone as one
        batch (upstream's order: the two rows as one batch) over a static KV cache sized for the prompt
        and the most draws (an index write a step instead of upstream's growing concatenation: the
        same numbers, checked at the released sizes, and no copy of the cache each step); in the
        model's continuous batch each row runs on a cache of its own, the batch applying `batch_head`.
        """
        if self.turbo:
            def head(h: torch.Tensor) -> torch.Tensor:
                return self.speech_head(h[:, -1:])[:, -1, :]
        else:
            def head(h: torch.Tensor) -> torch.Tensor:
                return self.speech_head(h)[:, -1, :]
        return SequenceSpec(decoder=self.tfmr, head=head, row_head=self.batch_head, rows=1 if self.turbo else 2,
                            stacked=True, what="T3", **declared)

    def _attach(self, steps: Any | None, prompt: torch.Tensor, most: int) -> Any:
        """The runtime's steps (alone when None) over caches for the (R, T, D) `prompt` and at most `most` more."""
        steps = steps if steps is not None else AloneSteps(self.sequence())
        cfg = self.tfmr.config

        def alone() -> StaticKVCache:
            return StaticKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, prompt.shape[1] + most,
                                 batch=prompt.shape[0])
        return steps.attach(alone, row=self.tfmr.new_cache)

    def batch_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Scores at the last position of normed hidden states (B, T, D): (V,) for B = 1, (B, V) else."""
        scores = self.speech_head(hidden[:, -1])
        return scores[0] if scores.shape[0] == 1 else scores

    # -- English ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, cond: torch.Tensor, text: torch.Tensor, options: T3Options,
                 generator: torch.Generator | None = None, max_new_tokens: int = MAX_NEW_TOKENS,
                 ban_stop: bool = False, steps: Any | None = None) -> Iterator[int]:
        """The English model's draws for text ids (L,) with [START]/[STOP] around them, the stop token last.

        ban_stop: the stop token is never drawn (benchmarks: exactly max_new_tokens draws); steps: the
        runtime's when it runs this loop (`Model.decode`; None: by itself here, its two rows as one batch).
        """
        if options.cfg_weight <= 0:
            raise ValueError("the English T3 samples with classifier-free guidance: cfg_weight must be > 0 "
                             "(upstream 0.1.7 fails at 0 too)")
        tokens = text.reshape(1, -1).expand(2, -1)
        text_emb = self.text_emb(tokens).clone()
        text_emb[1].zero_()  # the uncond row
        text_emb = text_emb + self.text_pos_emb(torch.arange(tokens.shape[1]))
        start = self.speech_emb(torch.tensor([[START_SPEECH]])) + self._speech_position(0)
        prompt = torch.cat([cond.expand(2, -1, -1), text_emb, start.expand(2, -1, -1), start.expand(2, -1, -1)], 1)
        forward = self._attach(steps, prompt, max_new_tokens).scores
        scores = yield from forward(prompt)
        drawn = [START_SPEECH]
        for i in range(max_new_tokens):
            cond_row, uncond_row = scores[0:1], scores[1:2]
            scores = cond_row + torch.as_tensor(options.cfg_weight, dtype=scores.dtype) * (cond_row - uncond_row)
            if ban_stop:  # before the filters, which then keep the likeliest of the others
                scores[:, STOP_SPEECH] = lp.NEG_INF
            ids = torch.tensor([drawn])
            scores = lp.repetition_penalty(ids, scores, float(options.repetition_penalty))
            if options.temperature != 1.0:
                scores = lp.temperature(scores, options.temperature)
            scores = lp.top_p(lp.min_p(scores, options.min_p), options.top_p)
            token = int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator))
            yield token
            if token == STOP_SPEECH:
                return
            drawn.append(token)
            step = self.speech_emb(torch.tensor([[token]])) + self._speech_position(i + 1)
            scores = yield from forward(step.expand(2, -1, -1))

    # -- Turbo -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate_turbo(self, cond: torch.Tensor, text: torch.Tensor, options: T3Options,
                       generator: torch.Generator | None = None,
                       max_new_tokens: int = TURBO_MAX_NEW_TOKENS, ban_stop: bool = False,
                       steps: Any | None = None) -> Iterator[int]:
        """Turbo's draws for GPT-2 text ids (L,), the stop token last when it was drawn (never with ban_stop);
        a stop as the first draw does not end it (upstream's loop never sees that draw);
        steps: the runtime's when it runs this loop (`Model.decode`; None: by itself here)."""
        start = torch.tensor([[START_SPEECH]])
        prompt = torch.cat([cond, self.text_emb(text.reshape(1, -1)), self.speech_emb(start)], dim=1)
        positions = self.tfmr.config.max_positions
        if prompt.shape[1] > positions:
            raise InvalidRequest(f"the text is too long for this model: {text.numel()} text ids with "
                                 f"{cond.shape[1]} conditioning positions exceed its {positions} positions",
                                 field="text")
        most = min(max_new_tokens + 1, positions - prompt.shape[1])
        forward = self._attach(steps, prompt, most).scores
        logits = yield from forward(prompt)
        drawn: list[int] = []
        for _ in range(max_new_tokens + 1):
            if ban_stop:  # before the filters, which then keep the likeliest of the others
                logits = logits.clone()
                logits[:, STOP_SPEECH] = lp.NEG_INF
            scores = self._turbo_scores(logits, torch.tensor([drawn]) if drawn else start, options)
            if drawn and bool(torch.all(scores == lp.NEG_INF)):
                return
            token = int(torch.multinomial(F.softmax(scores, dim=-1), 1, generator=generator))
            yield token
            drawn.append(token)
            # upstream draws the first token ahead of its loop and never checks it: a first stop is fed back
            if token == STOP_SPEECH and len(drawn) > 1:
                return
            if prompt.shape[1] + len(drawn) > positions:  # upstream fails on GPT-2's position table here
                raise InvalidRequest(f"the speech ran past this model's {positions} positions ({text.numel()} text "
                                     f"ids, {len(drawn)} speech tokens); split the text into several requests")
            logits = yield from forward(self.speech_emb(torch.tensor([[token]])))

    @staticmethod
    def _turbo_scores(scores: torch.Tensor, ids: torch.Tensor, o: T3Options) -> torch.Tensor:
        if o.temperature > 0 and o.temperature != 1.0:
            scores = lp.temperature(scores, o.temperature)
        if o.top_k > 0:
            scores = lp.top_k(scores, o.top_k)
        if o.top_p < 1.0:
            scores = lp.top_p(scores, o.top_p)
        if o.repetition_penalty != 1.0:
            scores = lp.repetition_penalty(ids, scores, float(o.repetition_penalty))
        return scores


def load_t3(path: str | Path) -> T3:
    """T3 from upstream's `t3_cfg.safetensors` (English) or `t3_turbo_v1.safetensors` (Turbo), sizes from the weights."""
    path = Path(path)
    state = read_weights(path)
    reduced = reduced_config(path.parent)
    d = state["speech_emb.weight"].shape[1]
    if "tfmr.wte.weight" in state:  # GPT-2
        gpt2 = reduced.get("t3_gpt2", {})
        backbone = DecoderConfig.from_dict({
            "model_type": "gpt2", "n_embd": d, "n_layer": count_children(state, "tfmr.h."),
            "n_head": gpt2.get("n_head", GPT2_HEADS), "n_positions": state["tfmr.wpe.weight"].shape[0],
            "n_inner": state["tfmr.h.0.mlp.c_fc.weight"].shape[1], "vocab_size": state["tfmr.wte.weight"].shape[0]})
        perceiver = None
        positions = (0, 0)
    else:
        llama = reduced.get("t3_llama", {})
        head_dim = llama.get("head_dim", LLAMA["head_dim"])
        backbone = DecoderConfig.from_dict(dict(
            LLAMA, hidden_size=d, num_hidden_layers=count_children(state, "tfmr.layers."), head_dim=head_dim,
            num_attention_heads=llama.get("num_attention_heads", d // head_dim),
            num_key_value_heads=llama.get("num_key_value_heads", d // head_dim),
            intermediate_size=state["tfmr.layers.0.mlp.gate_proj.weight"].shape[0],
            vocab_size=state["tfmr.embed_tokens.weight"].shape[0]))
        queries = state["cond_enc.perceiver.pre_attention_query"]
        perceiver = Perceiver(queries.shape[1], queries.shape[2],
                              reduced.get("t3_perceiver", {}).get("num_attn_heads", PERCEIVER_HEADS))
        positions = (state["text_pos_emb.emb.weight"].shape[0], state["speech_pos_emb.emb.weight"].shape[0])
    model = T3(backbone, state["text_emb.weight"].shape[0], state["speech_emb.weight"].shape[0], perceiver, *positions)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    keys = {k: k for k in shapes if not k.startswith("tfmr.")}
    keys.update({f"tfmr.{k}": v for k, v in model.tfmr.upstream_keys("tfmr.").items()})
    keys = {k: v.replace("pos_emb.weight", "pos_emb.emb.weight") for k, v in keys.items()}
    matched = match_state_dict(DictSource(state), keys, shapes, where=path, target="Chatterbox's T3")
    model.load_state_dict(matched)
    return model.eval()

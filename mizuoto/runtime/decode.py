"""Single-token decode of a Qwen decoder over a static KV cache, as CUDA graphs around attention.

Of a one-token step only the attention call sees a length that changes from token to token
(the static cache hands attention exactly the valid positions, which keeps the numerics of the
dynamic cache). So a step is L + 1 graphs: [rope, layer 0 up to attention, cache write],
L - 1 times [layer i-1 after attention, layer i up to attention, cache write], and
[last layer after attention, final norm, output head]; between them the L attention calls run
eagerly. The draw is a further graph (`GraphDraw`). Nothing here reads the device from the
host: the only wait per token is the caller's read of the drawn token. A continuous batch's
step (`BatchStep`) is cut the same way at its fixed width, with each row's cache write
and attention between the graphs.

Where graphs can't run (or are off) `GraphDecodeStep` runs the same ops eagerly, which is how
it is tested on the CPU against `Decoder.forward`; `BatchStep` is then `step_rows`.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from typing import Any, Callable, Protocol, Sequence

import torch

from mizuoto.runtime.graphs import GraphedCallable, new_pool, unavailable_reason, use_cuda_graphs
from mizuoto.nn.lm.kv_cache import StaticKVCache
from mizuoto.nn.lm.decoder import Decoder, attend
from mizuoto.nn.lm.sampling import FastSampler, nucleus_draw, on_device, random_draw


class GraphDecodeStep:
    """`step(embedding) -> scores`: one position through `decoder`, written into `cache`.

    `head` maps the final normed hidden state (1, 1, hidden) to what the caller samples from
    (e.g. CosyVoice's `llm_decoder(h[:, -1]).log_softmax(-1).squeeze(0)`); it is captured too.
    The returned tensor is overwritten by the next step. Build it (and call it) under the same
    autocast context as the eager decode; prefill with `decoder(inputs, cache)` first.
    """

    def __init__(self, decoder: Decoder, cache: StaticKVCache,
                 head: Callable[[torch.Tensor], torch.Tensor], *, graphs: bool = True,
                 pool: object | None = None) -> None:
        if not isinstance(cache, StaticKVCache):
            raise TypeError("a graphed decode step needs a StaticKVCache")
        weight = decoder.embed_tokens.weight
        cfg = decoder.config
        self.decoder, self.cache, self.head = decoder, cache, head
        self.layers = cfg.num_hidden_layers
        self.x = torch.zeros(1, 1, cfg.hidden_size, dtype=weight.dtype, device=weight.device)
        self.pos = torch.full((1,), min(cache.length, cache.max_len - 1), dtype=torch.long, device=weight.device)
        self.captured = graphs and unavailable_reason(weight.device) is None and cache.length < cache.max_len
        self.output: torch.Tensor | None = None  # the static scores tensor when captured
        if self.captured:
            self.captured = self._capture(cfg, weight, pool)
        if not self.captured:  # off CUDA, or a segment could not be captured: all run eagerly
            self.first, self.middle, self.last = self._first, [self._middle(i) for i in range(1, self.layers)], self._last

    def _capture(self, cfg, weight: torch.Tensor, pool: object | None) -> bool:
        pool = pool if pool is not None else new_pool(weight.device)
        self.first = GraphedCallable(self._first, [self.x, self.pos], pool=pool, inputs_are_static=True,
                                     name="decode step: layer 0 before attention")
        if not self.first.captured:
            return False
        cos, sin, q = self.first.outputs
        # attention's output has q's dtype (under autocast not the weights')
        attn = torch.zeros(1, 1, cfg.num_attention_heads, cfg.head_dim, dtype=q.dtype, device=weight.device)
        resid = self.x
        self.middle = []
        for i in range(1, self.layers):
            g = GraphedCallable(self._middle(i), [resid, attn, cos, sin, self.pos], pool=pool,
                                inputs_are_static=True, name=f"decode step: layers {i - 1}/{i}")
            if not g.captured:
                return False
            resid, q = g.outputs
            self.middle.append(g)
        self.last = GraphedCallable(self._last, [resid, attn], pool=pool, inputs_are_static=True,
                                    name="decode step: last layer and head")
        if not self.last.captured:
            return False
        self.output = self.last.outputs
        return True

    # --- the segments (the same code is captured or run eagerly) ---------------------------------

    def _first(self, x: torch.Tensor, pos: torch.Tensor):
        cos, sin = self.decoder.rope(pos.unsqueeze(0), x.dtype)
        q, k, v = self.decoder.layer_pre(0, x, cos, sin)
        self.cache.update(0, k, v, pos)
        return cos, sin, q

    def _middle(self, i: int):
        def run(resid: torch.Tensor, attn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                pos: torch.Tensor):
            x = self.decoder.layer_post(i - 1, resid, attn)
            q, k, v = self.decoder.layer_pre(i, x, cos, sin)
            self.cache.update(i, k, v, pos)
            return x, q
        return run

    def _last(self, resid: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = self.decoder.layer_post(self.layers - 1, resid, attn)
        return self.head(self.decoder.norm(x))

    # --- one step --------------------------------------------------------------------------------

    def __call__(self, embedding: torch.Tensor) -> torch.Tensor:
        """Feed one (1, 1, hidden) embedding at the cache's next position; return the head's output."""
        cache, dec = self.cache, self.decoder
        end = cache.length + 1
        if end > cache.max_len:
            raise RuntimeError(f"static KV cache overflow: {end} positions > its {cache.max_len}")
        if self.captured:
            self.x.copy_(embedding.reshape(self.x.shape))
            self.pos.fill_(cache.length)
            x, pos = self.x, self.pos
        else:
            x = embedding.reshape(self.x.shape)
            pos = torch.arange(cache.length, end, device=x.device)
        cos, sin, q = self.first(x, pos)
        resid = x
        for i in range(self.layers):
            attn = attend(q, cache.k[i, :, :, :end], cache.v[i, :, :, :end], dec.n_rep, dec.scale, None)
            if i + 1 < self.layers:
                resid, q = self.middle[i](resid, attn, cos, sin, pos)
            else:
                out = self.last(resid, attn)
        cache.advance(1)
        return out


class BatchStep:
    """`step(x, caches) -> scores (W, V)`: `Decoder.step_rows` + `head` at a fixed width W, as CUDA graphs
    where they can run (`graphs`, on CUDA), else eagerly.

    x is (W, 1, hidden), row r after `caches[r]` (None: an empty row). What treats every row the
    same (RoPE, norms, projections, MLP, the head) is L + 1 graphs at width W, as in
    `GraphDecodeStep`; between them each row's cache write and attention run eagerly over that
    row's own cache, dynamic or static (`Decoder.attend_rows`), so a step computes what
    `step_rows` computes, op for op. The graphs are captured at the first step and read the
    weights where they were then: a step after the decoder's parameters moved (a stage evicted
    and brought back) captures them again. Where graphs can't run (or their capture failed) a
    step is `step_rows` itself. When `captured`, the returned scores are overwritten by the next
    step.
    """

    def __init__(self, decoder: Decoder, head: Callable[[torch.Tensor], torch.Tensor], width: int,
                 *, graphs: bool = True) -> None:
        self.decoder, self.head, self.width, self.graphs = decoder, head, width, graphs
        self.layers = decoder.config.num_hidden_layers
        self.captured = False
        self.captures = 0          # how many times the graphs were (re)captured
        self._where: tuple | None = None  # the weights' addresses, dtype and device the graphs read

    def _first(self, x: torch.Tensor, pos: torch.Tensor):
        cos, sin = self.decoder.rope(pos[:, None], x.dtype)
        return (cos, sin, *self.decoder.layer_pre(0, x, cos, sin))

    def _middle(self, i: int):
        def run(resid: torch.Tensor, attn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
            x = self.decoder.layer_post(i - 1, resid, attn)
            return (x, *self.decoder.layer_pre(i, x, cos, sin))
        return run

    def _last(self, resid: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = self.decoder.layer_post(self.layers - 1, resid, attn)
        return self.head(self.decoder.norm(x)).reshape(self.width, -1)

    def _capture(self, x: torch.Tensor) -> bool:
        cfg, device = self.decoder.config, x.device
        pool = new_pool(device)
        self.x = torch.zeros_like(x)
        self.pos = torch.zeros(self.width, dtype=torch.long, device=device)
        first = GraphedCallable(self._first, [self.x, self.pos], pool=pool, inputs_are_static=True,
                                name="batched step: layer 0 before attention")
        if not first.captured:
            return False
        cos, sin, q, k, v = first.outputs
        self.attn = torch.zeros(self.width, 1, cfg.num_attention_heads, cfg.head_dim, dtype=q.dtype, device=device)
        self.segments, resid = [first], self.x
        for i in range(1, self.layers):
            g = GraphedCallable(self._middle(i), [resid, self.attn, cos, sin], pool=pool, inputs_are_static=True,
                                name=f"batched step: layers {i - 1}/{i}")
            if not g.captured:
                return False
            resid = g.outputs[0]
            self.segments.append(g)
        last = GraphedCallable(self._last, [resid, self.attn], pool=pool, inputs_are_static=True,
                               name="batched step: last layer and head")
        self.segments.append(last)
        return last.captured

    def _weights_at(self, x: torch.Tensor) -> tuple:
        kind = x.device.type
        return (x.device, x.dtype, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind),
                *(p.data_ptr() for p in self.decoder.parameters()))

    def __call__(self, x: torch.Tensor, caches: list) -> torch.Tensor:
        """One step of every row with a cache (x: (W, 1, hidden)); the head's output (W, V)."""
        dec = self.decoder
        if self.graphs and unavailable_reason(x.device) is None:
            where = self._weights_at(x)
            if where != self._where:
                self.captured, self._where = self._capture(x), where
                self.captures += 1
                if not self.captured:  # logged by GraphedCallable; eager from now on, graphs freed
                    self.segments = []
        else:
            self.captured = False
        if not self.captured:
            return self.head(dec.step_rows(x, caches)).reshape(self.width, -1)
        self.x.copy_(x)
        self.pos.copy_(dec.row_positions(caches, x.device))
        self.attn.zero_()  # an empty row's attention stays zeros, as in step_rows
        first, *middle, last = self.segments
        cos, sin, q, k, v = first(self.x, self.pos)
        resid = self.x
        for i in range(self.layers):
            dec.attend_rows(i, q, k, v, caches, self.pos, self.attn)
            if i + 1 < self.layers:
                resid, q, k, v = middle[i](resid, self.attn, cos, sin)
        dec.advance_rows(caches)
        return last(resid, self.attn)


class GraphDraw:
    """A `FastSampler` whose on-device nucleus draw is one CUDA graph over a static scores tensor.

    The graph draws from a private generator synced with the caller's before and after each
    replay, so the tokens and the generator state are those of the eager `FastSampler`.
    """

    def __init__(self, sampler: FastSampler, scores: torch.Tensor, *, graphs: bool = True,
                 pool: object | None = None) -> None:
        self.sampler = sampler
        self.scores = scores
        self.graph = None
        if sampler.kind != "random_sampling":
            top_p, top_k = sampler.top_p, sampler.top_k

            def draw(s: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
                return nucleus_draw(s, generator, top_p, top_k, fixed_draws=True)
            self.graph = GraphedCallable(draw, [scores], enabled=graphs, random=True, pool=pool,
                                         inputs_are_static=True, name="nucleus draw")

    @property
    def captured(self) -> bool:
        """Whether the draw replays a CUDA graph."""
        return self.graph is not None and self.graph.captured

    def __call__(self, scores: torch.Tensor, decoded: Sequence[int],
                 generator: torch.Generator | None) -> int:
        """Same contract as `FastSampler.__call__` (one host read; ras redraws eagerly)."""
        if self.graph is None:
            return random_draw(scores, generator)
        if self.graph.captured:
            token = self.graph(scores, generator=generator)
        else:
            token = self.sampler.draw(scores, generator)
        return self.sampler.finish(int(token.item()), scores, decoded, generator)


class TokenSteps(Protocol):
    """What an engine's token loop drives (runtime.sequence): `AloneSteps` over `DecodeSteps`, or `RowSteps` in a batch.

    The loop is a generator of token ids; `scores` and `next` are generators it runs with
    `yield from` (alone they yield nothing; in a batch they yield the batch's requests).
    """

    def attach(self, alone: Callable[[], Any], row: Callable[[], Any] | None = None) -> "TokenSteps":
        """Decode over the caches these make: `alone()` the whole sequence's, `row()` one batch row's."""

    def scores(self, inputs: torch.Tensor) -> Generator[Any, Any, torch.Tensor]:
        """Feed (R, T, hidden) inputs; the head's output for the last position."""

    def draw(self, scores: torch.Tensor, decoded: Sequence[int], generator: torch.Generator | None) -> int:
        """One token id from `scores`."""

    def compute(self, fn: Callable[[], Any]) -> Any:
        """fn() where the passes run."""

    def next(self, source: Iterator[Any]) -> Generator[Any, Any, Any]:
        """The next item of `source` the loop waits for between passes (streamed text); None at its end."""


class DecodeSteps:
    """A decode loop's scores and draws, as fast as the device allows, with upstream's tokens.

    Off CUDA: `decoder(inputs, cache)` + `head` and the given (upstream) sampler. On CUDA: the
    on-device `FastSampler` (one host read per token), and with `cuda_graphs` and a static
    cache the one-token step and the draw as CUDA graphs, captured after the first prefill.
    Multi-token inputs (prefills, streamed text) always run eagerly.
    """

    def __init__(self, decoder: Decoder, cache, head: Callable[[torch.Tensor], torch.Tensor],
                 sampler, *, cuda_graphs: bool = False, fast: bool | None = None,
                 what: str = "the LM") -> None:
        device = decoder.embed_tokens.weight.device
        self.decoder, self.cache, self.head = decoder, cache, head
        fast = device.type == "cuda" if fast is None else fast
        self.sampler = on_device(sampler) if fast else sampler
        why_not = None if isinstance(cache, StaticKVCache) else "it needs compute.kv_cache=static"
        if decoder.config.learned_positions:  # the graphed segments take RoPE tables, not position embeddings
            why_not = "a decoder with learned positions (GPT-2) decodes eagerly"
        self.graphs = use_cuda_graphs(cuda_graphs, device, what, why_not)
        self.step: GraphDecodeStep | None = None

    def attach(self, cache) -> "DecodeSteps":
        """Decode over `cache` (before the first step: graphs are captured over the cache they start with)."""
        if self.step is not None:
            raise ValueError("attach a cache before the first step")
        self.cache = cache
        return self

    def scores(self, inputs: torch.Tensor) -> torch.Tensor:
        """Feed (1, T, hidden) inputs; the head's output for the last position (may be a static buffer)."""
        if self.step is not None and inputs.shape[1] == 1:
            return self.step(inputs)
        scores = self.head(self.decoder(inputs, self.cache))
        if self.graphs and self.step is None:
            self.step = GraphDecodeStep(self.decoder, self.cache, self.head)
            if self.step.captured:
                if isinstance(self.sampler, FastSampler):  # an engine's own draw stays eager
                    self.sampler = GraphDraw(self.sampler, self.step.output)
        return scores

    def draw(self, scores: torch.Tensor, decoded: Sequence[int], generator: torch.Generator | None) -> int:
        """One token id from `scores` (which the sampler may modify, as upstream's does)."""
        return self.sampler(scores, decoded, generator)

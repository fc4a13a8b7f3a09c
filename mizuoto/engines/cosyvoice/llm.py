"""CosyVoice's speech-token LMs, inference: TransformerLM (v1), Qwen2LM (v2), CosyVoice3LM (v3).

Upstream: cosyvoice/llm/llm.py. The LM input is [sos, (v1: speaker embedding), text, task_id,
prompt speech-token embeddings], text being prompt text + text: v1 encodes it with its conformer
text encoder, v2/v3 embed it with Qwen's embed_tokens. v1/v2 take sos/task_id from
`llm_embedding`, v3 (which has none) from rows of `speech_embedding` past the speech tokens.
Decoding runs `2 * len(text)` .. `20 * len(text)` steps (prompt text excluded); a stop id ends it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from mizuoto.engines.cosyvoice.sampling import Sampler
from mizuoto.nn.transformer.wenet import ConformerEncoder, TransformerEncoder
from mizuoto.errors import InvalidRequest, MizuotoError, ModelLoadError
from mizuoto.runtime.convert.checkpoint import load_checkpoint, read_checkpoint
from mizuoto.runtime.sequence import AloneSteps, Sequence
from mizuoto.nn.lm.decoder import DecoderConfig, Decoder

VARIANTS = ("Qwen2LM", "CosyVoice3LM")  # on a Qwen2 decoder
V1_VARIANT = "TransformerLM"
_ENCODERS = {"ConformerEncoder": ConformerEncoder, "TransformerEncoder": TransformerEncoder}
# CosyVoice3LM.inference requires <|endofprompt|> in prompt_text + text (upstream hardcodes the id).
ENDOFPROMPT_ID = 151646
# CosyVoice3Model drops silent/breath tokens beyond a run of five (FSQ ids, upstream's list).
SILENT_TOKENS_V3 = frozenset({1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323})
MAX_SILENT_RUN = 5
# Planner bound of upstream's decode: a 300-position prompt, then 20 speech tokens per text token.
PROMPT_POSITIONS_CAP = 300
MAX_TOKEN_TEXT_RATIO = 20
MIN_TOKEN_TEXT_RATIO = 2


def drop_silent_runs(tokens: Iterable[int]) -> Iterator[int]:
    """v3: skip silent tokens once more than five have come in a row (CosyVoice3Model.llm_job)."""
    run = 0
    for token in tokens:
        if token in SILENT_TOKENS_V3:
            run += 1
            if run > MAX_SILENT_RUN:
                continue
        else:
            run = 0
        yield token


def _row(tokens: torch.Tensor | None, name: str) -> torch.Tensor:
    if tokens is None:
        return torch.zeros(1, 0, dtype=torch.int32)
    if tokens.dim() == 1:
        tokens = tokens.unsqueeze(0)
    if tokens.dim() != 2 or tokens.shape[0] != 1:
        raise InvalidRequest(f"{name}: expected token ids of shape (1, N), got {tuple(tokens.shape)}")
    return tokens


class QwenSpeechLM(nn.Module):
    """Qwen2LM / CosyVoice3LM: parameter names are upstream's except `llm.model.model.` -> `llm.`."""

    def __init__(self, variant: str, qwen: DecoderConfig, llm_input_size: int, llm_output_size: int,
                 speech_token_size: int, sampler: Sampler, mix_ratio: tuple[int, int] = (5, 15)) -> None:
        super().__init__()
        if variant not in VARIANTS:
            raise ModelLoadError(f"unknown Qwen speech LM {variant!r} (expected one of {VARIANTS})")
        if llm_input_size != qwen.hidden_size or llm_output_size != qwen.hidden_size:
            raise ModelLoadError(f"llm_input_size/llm_output_size {llm_input_size}/{llm_output_size} "
                                 f"differ from the Qwen hidden_size {qwen.hidden_size}")
        self.variant = variant
        self.speech_token_size = n = speech_token_size
        self.sampler = sampler
        self.mix_ratio = (int(mix_ratio[0]), int(mix_ratio[1]))  # text : prompt speech, bistream
        self.llm = Decoder(qwen)
        if variant == "Qwen2LM":
            self.llm_embedding = nn.Embedding(2, llm_input_size)
            self.llm_decoder = nn.Linear(llm_output_size, n + 3)
            self.speech_embedding = nn.Embedding(n + 3, llm_input_size)
            self.eos_token, self.fill_token = n, n + 2
            self.stop_token_ids = frozenset(range(n, n + 3))
        else:
            self.llm_decoder = nn.Linear(llm_output_size, n + 200, bias=False)
            self.speech_embedding = nn.Embedding(n + 200, llm_input_size)
            self.sos, self.eos_token, self.task_id, self.fill_token = n, n + 1, n + 2, n + 3
            self.stop_token_ids = frozenset(range(n, n + 200))

    @staticmethod
    def upstream_key(name: str) -> str:
        """The llm.pt key of one of our parameter names (the decoder sits at `llm.model.model.`)."""
        if name.startswith("llm.lm_head."):  # an untied head sits beside the decoder
            return "llm.model." + name[len("llm."):]
        return "llm.model.model." + name[len("llm."):] if name.startswith("llm.") else name

    def _special(self, which: str) -> torch.Tensor:
        if self.variant == "Qwen2LM":
            return self.llm_embedding.weight[{"sos": 0, "task_id": 1}[which]].reshape(1, 1, -1)
        return self.speech_embedding.weight[getattr(self, which)].reshape(1, 1, -1)

    def lm_input(self, text: torch.Tensor, prompt_text: torch.Tensor,
                 prompt_speech_token: torch.Tensor) -> torch.Tensor:
        """[sos, embed(prompt_text + text), task_id, speech_embedding(prompt tokens)] as (1, P, D)."""
        device = self.speech_embedding.weight.device
        text = torch.concat([prompt_text, text], dim=1).to(device)
        if self.variant == "CosyVoice3LM" and not bool((text == ENDOFPROMPT_ID).any()):
            raise InvalidRequest("CosyVoice 3 needs <|endofprompt|> (token 151646) in the text or prompt text",
                                 field="text")
        text_emb = self.llm.embed_tokens(text)
        if prompt_speech_token.shape[1] != 0:
            speech_emb = self.speech_embedding(prompt_speech_token.to(device))
        else:
            speech_emb = torch.zeros(1, 0, text_emb.shape[-1], dtype=text_emb.dtype, device=device)
        return torch.concat([self._special("sos"), text_emb, self._special("task_id"), speech_emb], dim=1)

    def cache_positions(self, prompt_positions: int, text_tokens: int,
                        max_token_text_ratio: float = MAX_TOKEN_TEXT_RATIO) -> int:
        """Positions a decode can fill: the prompt plus every fed-back token."""
        return prompt_positions + _scaled(text_tokens, max_token_text_ratio)

    @torch.inference_mode()
    def generate(self, text: torch.Tensor, prompt_text: torch.Tensor | None = None,
                 prompt_speech_token: torch.Tensor | None = None, *,
                 generator: torch.Generator | None = None, embedding: torch.Tensor | None = None,
                 cache: str = "dynamic", cache_len: int = 0, cuda_graphs: bool = False,
                 max_token_text_ratio: float = MAX_TOKEN_TEXT_RATIO,
                 min_token_text_ratio: float = MIN_TOKEN_TEXT_RATIO,
                 suppress_stop: bool = False, steps: Any | None = None) -> Iterator[int]:
        """Yield speech token ids as upstream's inference does, drawing from `generator`.

        The generator lives on the LM's device (None: the global one, as upstream draws).
        `embedding` (the speaker embedding) is accepted for a uniform call and unused, as in
        upstream's Qwen2LM. `cache` is "dynamic" or "static" (same tokens); a static cache has
        `cache_len` positions (e.g. the planner's bound), by default exactly what this request
        can fill. On CUDA the draw waits on the device once per token and, with `cuda_graphs`
        and a static cache, the one-token step replays CUDA graphs (same tokens); elsewhere this
        is upstream's loop and `cuda_graphs` a logged no-op. `suppress_stop` (benchmarks, not
        upstream) masks every stop id at every step, so exactly `max_len` tokens come. `steps`: the
        runtime's, when it runs this loop (`Model.decode`: alone, or as a row of the model's batch,
        which then runs the passes and builds the LM input on its loop's thread); None: alone here.
        """
        text, prompt_text = _row(text, "text"), _row(prompt_text, "prompt_text")
        prompt_speech_token = _row(prompt_speech_token, "prompt_speech_token")
        steps = self._steps(cuda_graphs, steps)
        lm_input = steps.compute(lambda: self.lm_input(text, prompt_text, prompt_speech_token))
        min_len = _scaled(text.shape[1], min_token_text_ratio)
        max_len = _scaled(text.shape[1], max_token_text_ratio)
        need = self.cache_positions(lm_input.shape[1], text.shape[1], max_token_text_ratio)
        if cache == "static" and 0 < cache_len < need:
            raise InvalidRequest(f"a static KV cache of {cache_len} positions is too small: "
                                 f"this request can fill {need}")
        steps.attach(lambda: self.llm.new_cache(cache, cache_len or need))
        out_tokens: list[int] = []
        for i in range(max_len):
            scores = yield from steps.scores(lm_input)
            if suppress_stop:
                scores[self.speech_token_size:] = -float("inf")
            token = self._draw(steps, scores, out_tokens, generator, ignore_eos=i < min_len)
            if token in self.stop_token_ids:
                break
            yield token
            out_tokens.append(token)
            lm_input = self.speech_embedding.weight[token].reshape(1, 1, -1)

    def step_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Log-probabilities of the next token from normed hidden states (B, T, H): (V,) for B = 1, else (B, V)."""
        return self.llm_decoder(hidden[:, -1]).log_softmax(dim=-1).squeeze(dim=0)

    def sequence(self, cuda_graphs: bool = False, **declared: Any) -> Sequence:
        """What the runtime runs this LM's token loop over (runtime.sequence): its decoder, head and sampler."""
        return Sequence(decoder=self.llm, head=self.step_head, sampler=self.sampler, cuda_graphs=cuda_graphs,
                        what=f"the {self.variant} LM", **declared)

    def _steps(self, cuda_graphs: bool, steps: Any | None = None) -> Any:
        # the runtime's steps when it runs the loop; by itself, the runtime's alone steps over this LM (off CUDA:
        # decoder + head and upstream's sampler, exactly upstream's loop)
        return steps if steps is not None else AloneSteps(self.sequence(cuda_graphs))

    def _draw(self, steps: Any, scores: torch.Tensor, out_tokens: list[int],
              generator: torch.Generator | None, ignore_eos: bool) -> int:
        if ignore_eos:
            # Only the first stop id is masked, as upstream does: v3 (eos = n + 1) and the
            # other stop ids can still end decoding before min_len.
            scores[self.speech_token_size] = -float("inf")
        return steps.draw(scores, out_tokens, generator)

    @torch.inference_mode()
    def generate_bistream(self, text: Iterable[torch.Tensor], prompt_text: torch.Tensor,
                          prompt_speech_token: torch.Tensor | None = None, *,
                          generator: torch.Generator | None = None, cache: str = "dynamic",
                          cache_len: int = 0, cuda_graphs: bool = False,
                          steps: Any | None = None) -> Iterator[int]:
        """Upstream's inference_bistream: text arrives in pieces (token rows) while tokens are yielded.

        Text and prompt speech are interleaved `mix_ratio` (5 : 15); then every 5 text tokens the
        LM speaks until it emits (or is forced to) the fill token. A static cache needs
        `cache_len`, since the text's length is unknown in advance. Decoding as in `generate`.
        """
        prompt_text = _row(prompt_text, "prompt_text")
        if prompt_text.shape[1] == 0:
            raise InvalidRequest("streaming text in needs the reference text (prompt text)", field="reference")
        prompt_speech_token = _row(prompt_speech_token, "prompt_speech_token")
        n_text, n_speech = self.mix_ratio
        embed, device = self.llm.embed_tokens, self.speech_embedding.weight.device
        prompt_text = prompt_text.to(device)
        eop = -1
        if self.variant == "CosyVoice3LM":
            ids = prompt_text.flatten().tolist()
            if ENDOFPROMPT_ID not in ids:
                raise InvalidRequest("CosyVoice 3 needs <|endofprompt|> (token 151646) in the prompt text",
                                     field="reference")
            eop = ids.index(ENDOFPROMPT_ID)

        def prelude() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            if prompt_speech_token.shape[1] != 0:
                speech = self.speech_embedding(prompt_speech_token.to(device))
            else:
                speech = torch.zeros(1, 0, self.speech_embedding.embedding_dim, device=device)
            lm_input = self._special("sos")
            if eop >= 0:
                lm_input = torch.concat([lm_input, embed(prompt_text[:, :eop + 1])], dim=1)
            return lm_input, embed(prompt_text[:, eop + 1:]), speech

        def take_piece(piece, lm_input, text_cache, speech) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            text_cache = torch.concat([text_cache, embed(_row(piece, "text").to(device))], dim=1)
            while speech.shape[1] != 0 and text_cache.shape[1] >= n_text:
                lm_input = torch.concat([lm_input, text_cache[:, :n_text], speech[:, :n_speech]], dim=1)
                text_cache, speech = text_cache[:, n_text:], speech[:, n_speech:]
            return lm_input, text_cache, speech

        steps = self._steps(cuda_graphs, steps)
        lm_input, text_cache, speech = steps.compute(prelude)
        next_fill = (int(prompt_speech_token.shape[1] / n_speech) + 1) * n_speech - prompt_speech_token.shape[1]
        steps.attach(lambda: self.llm.new_cache(cache, cache_len))
        out: list[int] = []
        pieces = iter(text)
        while (piece := (yield from steps.next(pieces))) is not None:
            lm_input, text_cache, speech = steps.compute(lambda: take_piece(piece, lm_input, text_cache, speech))
            if speech.shape[1] != 0:
                continue
            after_fill = bool(out) and out[-1] == self.fill_token
            if after_fill or (not out and lm_input.shape[1] == 1):
                if text_cache.shape[1] < n_text:
                    continue
                head = text_cache[:, :n_text]
                lm_input = head if after_fill else steps.compute(lambda: torch.concat([lm_input, head], dim=1))
                text_cache = text_cache[:, n_text:]
            while True:
                scores = yield from steps.scores(lm_input)
                if next_fill != -1 and len(out) == next_fill:
                    token = self.fill_token  # forced: nothing is drawn
                    next_fill += n_speech + 1
                else:
                    token = self._draw(steps, scores, out, generator, ignore_eos=True)
                if token == self.fill_token:
                    next_fill = len(out) + n_speech + 1
                out.append(token)
                if token >= self.speech_token_size:
                    if token == self.fill_token:
                        # lm_input keeps the input already fed, as upstream (it is fed again if
                        # the text ends here)
                        break
                    raise MizuotoError(f"the LM produced special token {token} before the text ended "
                                       "(upstream raises here too)")
                yield token
                lm_input = self.speech_embedding.weight[token].reshape(1, 1, -1)
        lm_input = steps.compute(lambda: torch.concat([lm_input, text_cache, self._special("task_id")], dim=1))
        while True:
            token = self._draw(steps, (yield from steps.scores(lm_input)), out, generator, ignore_eos=False)
            out.append(token)
            if token >= self.speech_token_size:
                if token == self.eos_token:
                    break
                raise MizuotoError(f"the LM produced special token {token} instead of eos (upstream raises here too)")
            yield token
            lm_input = self.speech_embedding.weight[token].reshape(1, 1, -1)


class TransformerSpeechLM(nn.Module):
    """CosyVoice 1's TransformerLM: conformer text encoder + transformer LM; upstream's names."""

    variant = V1_VARIANT

    def __init__(self, text_encoder_input_size: int, llm_input_size: int, llm_output_size: int,
                 text_token_size: int, speech_token_size: int, text_encoder: nn.Module,
                 llm: nn.Module, sampler: Sampler, spk_embed_dim: int = 192) -> None:
        super().__init__()
        self.llm_input_size = llm_input_size
        self.speech_token_size = speech_token_size
        self.sampler = sampler
        self.text_embedding = nn.Embedding(text_token_size, text_encoder_input_size)
        self.text_encoder = text_encoder
        self.text_encoder_affine_layer = nn.Linear(text_encoder.output_size(), llm_input_size)
        self.llm_embedding = nn.Embedding(2, llm_input_size)  # rows: sos, task_id
        self.llm = llm
        self.llm_decoder = nn.Linear(llm_output_size, speech_token_size + 1)
        self.speech_embedding = nn.Embedding(speech_token_size, llm_input_size)
        self.spk_embed_affine_layer = nn.Linear(spk_embed_dim, llm_input_size)
        self.eos_token = speech_token_size

    @staticmethod
    def upstream_key(name: str) -> str:
        """The llm.pt key of one of our parameter names (the same)."""
        return name

    def lm_input(self, text: torch.Tensor, prompt_text: torch.Tensor, prompt_speech_token: torch.Tensor,
                 embedding: torch.Tensor | None) -> torch.Tensor:
        """[sos, speaker embedding (if any), encoded text, task_id, prompt speech embeddings]."""
        device = self.speech_embedding.weight.device
        text = torch.concat([prompt_text, text], dim=1).to(device)
        lengths = torch.tensor([text.shape[1]], dtype=torch.int32, device=device)
        encoded, _ = self.text_encoder(self.text_embedding(text), lengths, decoding_chunk_size=1,
                                       num_decoding_left_chunks=-1)
        encoded = self.text_encoder_affine_layer(encoded)
        if embedding is not None and embedding.shape[0] != 0:
            spk = self.spk_embed_affine_layer(F.normalize(embedding.to(device), dim=1)).unsqueeze(dim=1)
        else:
            spk = torch.zeros(1, 0, self.llm_input_size, dtype=encoded.dtype, device=device)
        if prompt_speech_token.shape[1] != 0:
            speech = self.speech_embedding(prompt_speech_token.to(device))
        else:
            speech = torch.zeros(1, 0, self.llm_input_size, dtype=encoded.dtype, device=device)
        sos = self.llm_embedding.weight[0].reshape(1, 1, -1)
        task_id = self.llm_embedding.weight[1].reshape(1, 1, -1)
        return torch.concat([sos, spk, encoded, task_id, speech], dim=1)

    @torch.inference_mode()
    def generate(self, text: torch.Tensor, prompt_text: torch.Tensor | None = None,
                 prompt_speech_token: torch.Tensor | None = None, *,
                 generator: torch.Generator | None = None, embedding: torch.Tensor | None = None,
                 cache: str = "dynamic", max_token_text_ratio: float = MAX_TOKEN_TEXT_RATIO,
                 min_token_text_ratio: float = MIN_TOKEN_TEXT_RATIO, suppress_stop: bool = False,
                 steps: Any | None = None) -> Iterator[int]:
        """Yield speech token ids as upstream's TransformerLM.inference does.

        The wenet LM keeps its own growing cache and runs its own passes (`cache` and the runtime's
        `steps` are accepted for a uniform call: it never batches); `suppress_stop` (benchmarks)
        keeps it speaking to its maximum length.
        """
        text, prompt_text = _row(text, "text"), _row(prompt_text, "prompt_text")
        prompt_speech_token = _row(prompt_speech_token, "prompt_speech_token")
        lm_input = self.lm_input(text, prompt_text, prompt_speech_token, embedding)
        min_len = _scaled(text.shape[1], min_token_text_ratio)
        max_len = _scaled(text.shape[1], max_token_text_ratio)
        device = lm_input.device
        att_cache = torch.zeros((0, 0, 0, 0), device=device)
        cnn_cache = torch.zeros((0, 0, 0, 0), device=device)
        out_tokens: list[int] = []
        offset = 0
        for i in range(max_len):
            n = lm_input.shape[1]
            causal = torch.tril(torch.ones((1, n, n), device=device)).to(torch.bool)
            hidden, att_cache, cnn_cache = self.llm.forward_chunk(
                lm_input, offset=offset, required_cache_size=-1, att_cache=att_cache,
                cnn_cache=cnn_cache, att_mask=causal)
            scores = self.llm_decoder(hidden[:, -1]).log_softmax(dim=-1).squeeze(dim=0)
            if i < min_len or suppress_stop:
                scores[self.speech_token_size] = -float("inf")
            token = self.sampler(scores, out_tokens, generator)
            if token == self.eos_token:
                break
            yield token
            out_tokens.append(token)
            offset += n
            lm_input = self.speech_embedding.weight[token].reshape(1, 1, -1)


def _encoder(node, where: str) -> nn.Module:
    cls = getattr(node, "cls", None)
    if cls not in _ENCODERS:
        raise ModelLoadError(f"{where}: unsupported encoder {getattr(node, 'target', node)!r}")
    try:
        return _ENCODERS[cls](**node.kwargs)
    except (TypeError, ValueError, NotImplementedError) as exc:
        raise ModelLoadError(f"{where}: {exc}") from None


def _build_v1(node) -> TransformerSpeechLM:
    names = ("text_encoder_input_size", "llm_input_size", "llm_output_size", "text_token_size",
             "speech_token_size")
    try:
        sizes = {k: int(node[k]) for k in names}
        text_encoder, llm, sampling = node["text_encoder"], node["llm"], node["sampling"]
    except KeyError as exc:
        raise ModelLoadError(f"llm: missing {exc.args[0]!r} in the yaml") from None
    return TransformerSpeechLM(**sizes, spk_embed_dim=int(node.get("spk_embed_dim", 192)),
                               text_encoder=_encoder(text_encoder, "llm.text_encoder"),
                               llm=_encoder(llm, "llm.llm"), sampler=Sampler.from_yaml(sampling))


def _scaled(n: int, ratio: float) -> int:
    # upstream multiplies an int32 length tensor by the ratio, then truncates with int()
    return int(torch.tensor([n], dtype=torch.int32) * ratio)


def build_lm(llm_node, model_dir: str | Path) -> nn.Module:
    """The LM the yaml's `llm` node describes (v2/v3: Qwen sizes from <model_dir>/CosyVoice-BlankEN)."""
    variant = getattr(llm_node, "cls", None)
    if variant == V1_VARIANT:
        return _build_v1(llm_node)
    if variant not in VARIANTS:
        raise ModelLoadError(f"llm: unsupported LM class {getattr(llm_node, 'target', llm_node)!r}")
    try:
        sizes = {k: int(llm_node[k]) for k in ("llm_input_size", "llm_output_size", "speech_token_size")}
    except KeyError as exc:
        raise ModelLoadError(f"llm: missing {exc.args[0]!r} in the yaml") from None
    config = Path(model_dir) / "CosyVoice-BlankEN" / "config.json"
    qwen = DecoderConfig.from_json(config)
    if qwen.arch != "qwen2":  # upstream builds Qwen2ForCausalLM from it, whatever it says
        raise ModelLoadError(f"{config}: model_type {qwen.arch!r} is not qwen2")
    sampling = llm_node.get("sampling")
    if sampling is None:
        raise ModelLoadError("llm: missing 'sampling' in the yaml")
    mix_ratio = tuple(llm_node.get("mix_ratio", (5, 15)))
    return QwenSpeechLM(variant, qwen, sampler=Sampler.from_yaml(sampling), mix_ratio=mix_ratio, **sizes)


# Upstream stores Qwen2ForCausalLM under `llm.model`: its decoder at `llm.model.model.`, its head
# at `llm.model.lm_head` (present in the file even when tied to embed_tokens, sharing storage).
_QWEN_HEAD, _QWEN_EMBED = "llm.model.lm_head.weight", "llm.model.model.embed_tokens.weight"


def load_lm_state(lm: nn.Module, path: str | Path) -> None:
    """Load upstream's llm.pt (strict): every key mapped by `upstream_key`, counted and shape-checked."""
    state = read_checkpoint(path)
    target = f"the yaml's {lm.variant} LM"
    ignore: tuple[str, ...] = ()
    if isinstance(lm, QwenSpeechLM) and lm.llm.lm_head is None:
        head, embed = state.get(_QWEN_HEAD), state.get(_QWEN_EMBED)
        if head is None:
            raise ModelLoadError(f"{path} does not match {target}: missing keys: {_QWEN_HEAD}")
        # torch.save keeps a tied head once; a checkpoint whose head differs is not this model
        if embed is not None and not (head.data_ptr() == embed.data_ptr() or torch.equal(head, embed)):
            raise ModelLoadError(f"{path}: {_QWEN_HEAD} differs from the tied embed_tokens")
        ignore = (_QWEN_HEAD,)
    key_map = {name: lm.upstream_key(name) for name in lm.state_dict()}
    load_checkpoint(lm, path, key_map, target=target, ignore=ignore, state=state)


def load_lm(model_dir: str | Path, config: dict) -> nn.Module:
    """Build the LM from the parsed yaml and load <model_dir>/llm.pt into it (eval mode)."""
    if "llm" not in config:
        raise ModelLoadError(f"{model_dir}: the yaml has no 'llm' entry")
    lm = build_lm(config["llm"], model_dir)
    load_lm_state(lm, Path(model_dir) / "llm.pt")
    return lm.eval()

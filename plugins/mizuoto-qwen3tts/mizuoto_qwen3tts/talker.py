"""The talker: Qwen3-TTS's LM over codec frames, a Qwen3 decoder (`mizuoto.nn.lm.decoder`) read from the model dir.

Upstream's talker (`Qwen3TTSTalkerModel`) is a Qwen3 decoder whose token table is the codec's
(`codec_embedding`: codebook 0 and the control ids) and whose head is `codec_head`; it reads
`inputs_embeds` the engine builds (text projected, codec ids embedded, added position by
position). The text side of its prompts is its own too: a text token table (`text_embedding`,
at `text_hidden_size`) and `text_projection`, a two-layer MLP resizing text rows to the talker's
width (`TextProjection`). Its RoPE is "multimodal" (`mrope_section`, interleaved), but a speech
prompt gives the three position axes the same positions, so every rotation equals plain RoPE on
those positions (checked against upstream's recording); a config asking for anything else is refused.
Sizes come from `config.json`'s `talker_config`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from mizuoto.errors import ModelLoadError
from mizuoto.nn.lm.decoder import Decoder, DecoderConfig
from mizuoto_qwen3tts.weights import load_into, read_config

PREFIX = "talker."
# upstream's names under PREFIX -> ours in `Talker`, where they differ
RENAMED = {"model.codec_embedding.weight": "decoder.embed_tokens.weight", "codec_head.weight": "head.weight",
           "model.text_embedding.weight": "text_embedding.weight"}
# under PREFIX, read by another part: the code predictor
NOT_TALKER_PREFIXES = ("code_predictor.",)


def qwen3_config(cfg: dict, where: str, what: str) -> DecoderConfig:
    """A Qwen3 decoder's sizes from one of upstream's sub-configs (the talker's or the code predictor's)."""
    try:
        if cfg.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"{where}: {what} hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
        if cfg.get("use_sliding_window") or any(t != "full_attention" for t in cfg.get("layer_types") or ()):
            raise ModelLoadError(f"{where}: a {what} with sliding-window layers is not supported")
        bias = bool(cfg.get("attention_bias", False))
        return DecoderConfig(
            hidden_size=int(cfg["hidden_size"]), intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]), num_attention_heads=int(cfg["num_attention_heads"]),
            num_key_value_heads=int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
            vocab_size=int(cfg["vocab_size"]), arch="qwen3", norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", 10000.0)), head_dim=int(cfg.get("head_dim") or 0),
            qkv_bias=bias, o_bias=bias, qk_norm=True)
    except KeyError as exc:
        raise ModelLoadError(f"{where}: the {what} config lacks {exc.args[0]!r}") from None


def talker_config(config: dict, where: str = "config.json") -> DecoderConfig:
    """The talker's decoder sizes from a model dir's `config.json` (its `talker_config`)."""
    if "talker_config" not in config:
        raise ModelLoadError(f"{where}: no talker_config (not a Qwen3-TTS model?)")
    cfg = config["talker_config"]
    scaling = cfg.get("rope_scaling") or {}
    if scaling and (scaling.get("rope_type", "default") != "default" or not scaling.get("interleaved", True)):
        raise ModelLoadError(f"{where}: talker rope_scaling {scaling!r} is not supported "
                             "(default multimodal RoPE, interleaved, only)")
    return qwen3_config(cfg, where, "talker")


class TextProjection(nn.Module):
    """Text rows to the talker's width: fc2(silu(fc1(x))), both with biases (upstream's resize MLP)."""

    def __init__(self, text_hidden: int, hidden: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(text_hidden, text_hidden, bias=True)
        self.linear_fc2 = nn.Linear(text_hidden, hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, text hidden) -> (B, T, hidden)."""
        return self.linear_fc2(nn.functional.silu(self.linear_fc1(x)))


class Talker(nn.Module):
    """The talker's decoder (its token table the codec's), its codec head, and its text table and projection."""

    def __init__(self, cfg: DecoderConfig, text_vocab: int, text_hidden: int) -> None:
        super().__init__()
        self.decoder = Decoder(cfg)
        self.decoder.lm_head = None  # the talker's head is `head` (upstream's codec_head)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.text_embedding = nn.Embedding(text_vocab, text_hidden)
        self.text_projection = TextProjection(text_hidden, cfg.hidden_size)

    def text(self, ids: torch.Tensor) -> torch.Tensor:
        """Text token ids (B, T) as the talker reads them: projected text embeddings (B, T, hidden)."""
        return self.text_projection(self.text_embedding(ids))

    def codec(self, ids: torch.Tensor) -> torch.Tensor:
        """Codec ids (codebook 0 and the control, language and speaker ids) embedded by the talker's table."""
        return self.decoder.embed_tokens(ids)


def load_talker(model_dir: str | Path) -> Talker:
    """The talker from `model_dir` (float32, eval mode)."""
    config = read_config(model_dir)
    where = str(Path(model_dir) / "config.json")
    cfg = talker_config(config, where)
    try:
        text_vocab = int(config["talker_config"]["text_vocab_size"])
        text_hidden = int(config["talker_config"]["text_hidden_size"])
    except KeyError as exc:
        raise ModelLoadError(f"{where}: the talker config lacks {exc.args[0]!r}") from None
    talker = Talker(cfg, text_vocab, text_hidden).eval()
    load_into(talker, model_dir, PREFIX, RENAMED, NOT_TALKER_PREFIXES, moved={"model.": "decoder."})
    return talker

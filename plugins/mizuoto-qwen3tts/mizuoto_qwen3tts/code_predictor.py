"""The code predictor: per frame, codebooks 1..15 from the talker's hidden state and codebook 0.

Upstream's `Qwen3TTSTalkerCodePredictorModelForConditionalGeneration` is a small Qwen3 decoder
(`config.json`'s `talker_config.code_predictor_config`) that, for each frame, reads two inputs
first (the talker's last hidden state and codebook 0 embedded by the talker's own table), then
one per drawn codebook (codebook i embedded by its own table `codec_embedding[i - 1]`, at the
talker's width); every input is projected to its width (`small_to_mtp_projection`, an identity
where the widths agree) and codebook i is drawn from head `lm_head[i - 1]`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from mizuoto.errors import ModelLoadError
from mizuoto.nn.lm.decoder import Decoder, DecoderConfig
from mizuoto_qwen3tts.talker import qwen3_config
from mizuoto_qwen3tts.weights import load_into, read_config

PREFIX = "talker.code_predictor."


class CodePredictor(nn.Module):
    """The predictor's decoder, its tables and heads (one per codebook 1..15) and its input projection."""

    def __init__(self, cfg: DecoderConfig, talker_hidden: int, groups: int) -> None:
        super().__init__()
        self.decoder = Decoder(cfg)
        # its inputs are embedded by the tables below (at the talker's width), never by a table of its own
        self.decoder.embed_tokens, self.decoder.lm_head = None, None
        self.tables = nn.ModuleList(nn.Embedding(cfg.vocab_size, talker_hidden) for _ in range(groups - 1))
        self.heads = nn.ModuleList(nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) for _ in range(groups - 1))
        self.project = (nn.Linear(talker_hidden, cfg.hidden_size, bias=True) if talker_hidden != cfg.hidden_size
                        else nn.Identity())

    def logits(self, inputs: torch.Tensor, cache, codebook: int) -> torch.Tensor:
        """Logits of `codebook` (1..15) after `inputs` (B, T, talker width): its head over every position."""
        return self.heads[codebook - 1](self.decoder(self.project(inputs), cache))


def load_code_predictor(model_dir: str | Path) -> CodePredictor:
    """The code predictor from `model_dir` (float32, eval mode)."""
    config = read_config(model_dir)
    where = str(Path(model_dir) / "config.json")
    try:
        talker = config["talker_config"]
        cfg = talker["code_predictor_config"]
        groups, width = int(talker["num_code_groups"]), int(talker["hidden_size"])
    except KeyError as exc:
        raise ModelLoadError(f"{where}: no {exc.args[0]!r} (not a Qwen3-TTS model?)") from None
    model = CodePredictor(qwen3_config(cfg, where, "code predictor"), width, groups).eval()
    renamed = {f"model.codec_embedding.{i}.weight": f"tables.{i}.weight" for i in range(groups - 1)}
    renamed |= {f"lm_head.{i}.weight": f"heads.{i}.weight" for i in range(groups - 1)}
    renamed |= {"small_to_mtp_projection.weight": "project.weight", "small_to_mtp_projection.bias": "project.bias"}
    load_into(model, model_dir, PREFIX, renamed, moved={"model.": "decoder."})
    return model

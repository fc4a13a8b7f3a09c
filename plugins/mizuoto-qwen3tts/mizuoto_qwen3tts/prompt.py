"""The text a Qwen3-TTS request speaks, as the model reads it: chat-formatted prompts and their token ids.

Upstream (`qwen-tts` 0.1.1) wraps each text in the Qwen chat format before tokenizing it, and the
model then cuts the ids by position (fixtures/README.md of this plugin's tests):
- the text to speak: `<|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>assistant\\n`; the first 3 ids
  are the role, the last 5 are never spoken;
- a clone's reference transcript: `<|im_start|>assistant\\n{ref_text}<|im_end|>\\n`; ids 3 to -2 are spoken;
- an instruction (CustomVoice, VoiceDesign): the user's turn, `<|im_start|>user\\n{instruct}<|im_end|>\\n`,
  embedded whole.
So "assistant", "user" and "\\n" must each be one token, which `Prompts` checks at load. The tokenizer
is the model directory's own Qwen2 byte-level BPE (vocab.json, merges.txt and the added tokens of
tokenizer_config.json; `mizuoto.text.tokenize.qwen`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from mizuoto.errors import ModelLoadError
from mizuoto.text.tokenize.qwen import QwenTokenizer

ROLE_IDS = 3  # <|im_start|>, the role, "\n"
UNSPOKEN_TAIL = 5  # <|im_end|>, "\n", <|im_start|>, "assistant", "\n"
REF_TAIL = 2  # <|im_end|>, "\n"


def speech_prompt(text: str) -> str:
    """The chat turn that carries the text to speak."""
    return f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"


def reference_prompt(ref_text: str) -> str:
    """The chat turn that carries a clone's reference transcript."""
    return f"<|im_start|>assistant\n{ref_text}<|im_end|>\n"


def instruction_prompt(instruct: str) -> str:
    """The user's turn that carries an instruction (a speaking style, or a voice to design)."""
    return f"<|im_start|>user\n{instruct}<|im_end|>\n"


class Prompts:
    """A model directory's tokenizer, turning texts into the (1, L) int64 ids the model reads."""

    def __init__(self, model_dir: str | Path) -> None:
        self.tokenizer = QwenTokenizer.from_dir(model_dir, "qwen2")
        for piece in ("assistant", "user", "\n"):
            ids = self.tokenizer.encode(piece)
            if len(ids) != 1:  # the model cuts its prompts by position
                raise ModelLoadError(f"{model_dir}: the tokenizer splits {piece!r} into {len(ids)} tokens; "
                                     "a Qwen3-TTS tokenizer keeps it one")

    def ids(self, prompt: str) -> torch.Tensor:
        """The prompt's token ids, (1, L) int64."""
        return torch.tensor([self.tokenizer.encode(prompt)], dtype=torch.int64)

    def speech(self, text: str) -> torch.Tensor:
        """Ids of the text to speak, in its chat turn."""
        return self.ids(speech_prompt(text))

    def reference(self, ref_text: str) -> torch.Tensor:
        """Ids of a clone's reference transcript, in its chat turn."""
        return self.ids(reference_prompt(ref_text))

    def instruction(self, instruct: str) -> torch.Tensor:
        """Ids of an instruction, in the user's turn."""
        return self.ids(instruction_prompt(instruct))

"""Text tokenizers: Qwen2 BPE for CosyVoice2/3, Whisper tiktoken for CosyVoice v1."""

from mizuoto.text.tokenize.qwen import QwenTokenizer
from mizuoto.text.tokenize.whisper import WhisperTokenizer

__all__ = ["QwenTokenizer", "WhisperTokenizer"]

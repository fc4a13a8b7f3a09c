"""Which CosyVoice generation a directory holds, and what each generation is made of.

The yaml's file name decides the generation (as upstream's AutoModel); its tags must then name
the classes that generation uses, so a renamed or foreign yaml is refused before any weight loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mizuoto.errors import ModelLoadError
from mizuoto.runtime.hyperyaml import load_hyperyaml


@dataclass(frozen=True)
class Variant:
    """One CosyVoice generation: its yaml, tokenizer files and the classes its yaml may name."""

    version: int
    yaml_name: str
    speech_tokenizer: str
    llm_classes: tuple[str, ...]
    flow_classes: tuple[str, ...]
    hift_classes: tuple[str, ...]
    text_tokenizer: str          # "whisper" | "qwen"
    instruct_mode: str           # "instruct" (preset speaker + instruct) | "instruct2" (clone + instruct)
    system_prompt: str = ""      # prepended to v3 prompts that lack <|endofprompt|>


VARIANTS: tuple[Variant, ...] = (
    Variant(1, "cosyvoice.yaml", "speech_tokenizer_v1.onnx", ("TransformerLM",), ("MaskedDiffWithXvec",),
            ("HiFTGenerator",), "whisper", "instruct"),
    Variant(2, "cosyvoice2.yaml", "speech_tokenizer_v2.onnx", ("Qwen2LM",), ("CausalMaskedDiffWithXvec",),
            ("HiFTGenerator",), "qwen", "instruct2"),
    Variant(3, "cosyvoice3.yaml", "speech_tokenizer_v3.onnx", ("CosyVoice3LM",), ("CausalMaskedDiffWithDiT",),
            ("CausalHiFTGenerator",), "qwen", "instruct2",
            system_prompt="You are a helpful assistant.<|endofprompt|>"),
)

ENDOFPROMPT = "<|endofprompt|>"


def find_variant(model_dir: str | Path) -> Variant | None:
    """The generation whose yaml the directory holds, None if it holds none; several is an error."""
    model_dir = Path(model_dir)
    found = [v for v in VARIANTS if (model_dir / v.yaml_name).is_file()]
    if len(found) > 1:
        names = ", ".join(v.yaml_name for v in found)
        raise ModelLoadError(f"{model_dir} holds several CosyVoice yamls ({names}); keep exactly one")
    return found[0] if found else None


def load_config(model_dir: str | Path, variant: Variant) -> dict[str, Any]:
    """Parse the variant's yaml and check that it names the classes this generation is made of."""
    path = Path(model_dir) / variant.yaml_name
    config = load_hyperyaml(path)
    for key, allowed in (("llm", variant.llm_classes), ("flow", variant.flow_classes),
                         ("hift", variant.hift_classes)):
        node = config.get(key)
        cls = getattr(node, "cls", None)
        if cls not in allowed:
            raise ModelLoadError(
                f"{path}: `{key}` is {cls or 'missing'}, but a CosyVoice {variant.version} yaml "
                f"must use {' or '.join(allowed)} (unknown variant)")
    return config

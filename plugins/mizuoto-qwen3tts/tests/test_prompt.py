"""Every recorded text turns into the ids upstream's tokenizer gave (integers: exact on every CPU)."""

import pytest
import torch

from mizuoto.errors import ModelLoadError
from mizuoto_qwen3tts.prompt import Prompts

# the record's key -> (the call's keyword argument, how that text is turned into a prompt)
TEXTS = {"input_ids": ("text", Prompts.speech), "ref_ids": ("ref_text", Prompts.reference),
         "instruct_ids": ("instruct", Prompts.instruction)}


def test_each_recorded_text_gives_upstreams_ids(case):
    prompts, recorded, kwargs = Prompts(case.model_dir), case.tensors(), case.kwargs
    compared = 0
    for key, (argument, make) in TEXTS.items():
        if key not in recorded:
            continue
        ours = make(prompts, kwargs[argument])
        assert torch.equal(ours, recorded[key]), f"{case.name} {key}: {ours.tolist()} != {recorded[key].tolist()}"
        compared += 1
    assert compared >= 1 and "input_ids" in recorded  # every case speaks a text


def test_a_tokenizer_that_splits_the_role_is_refused(tmp_path):
    """The model cuts its prompts by position: a vocabulary without "assistant" as one token cannot serve it."""
    import json

    (tmp_path / "vocab.json").write_text(json.dumps({c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz")}),
                                         encoding="utf-8")
    (tmp_path / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    with pytest.raises(ModelLoadError, match="'assistant' into 9 tokens"):
        Prompts(tmp_path)

"""A Qwen3-TTS request's settings: upstream's generate_* keyword arguments, as Mizuoto request options.

The names are upstream's (`language`, `non_streaming_mode`, the sampling arguments and their
`subtalker_*` twins for the code predictor, `max_new_tokens`). A model's defaults are upstream's:
its `generation_config.json`, else upstream's hard defaults (`_merge_generate_kwargs`); text
streaming into the talker (`non_streaming_mode` False) is the default of a clone, reading the whole
text first that of CustomVoice and VoiceDesign, as upstream's three methods default.
"""

from __future__ import annotations

from typing import Any, Mapping

from mizuoto.runtime.engine import RequestOption
from mizuoto_qwen3tts.layout import AUTO, ModelLayout

# upstream's hard defaults (`Qwen3TTSModel._merge_generate_kwargs`), under generation_config.json
HARD_DEFAULTS = {"do_sample": True, "top_k": 50, "top_p": 1.0, "temperature": 0.9, "repetition_penalty": 1.05,
                 "subtalker_dosample": True, "subtalker_top_k": 50, "subtalker_top_p": 1.0,
                 "subtalker_temperature": 0.9, "max_new_tokens": 2048}
MOST_NEW_TOKENS = 8192  # the released models' generation_config.json: 8192 frames + 1 at 12.5 Hz is 11 minutes

_HELP = {
    "do_sample": "sample the talker's codes (false: the likeliest each step)",
    "top_k": "the talker samples among this many likeliest codes (0: off)",
    "top_p": "the talker's nucleus sampling: keep the likeliest codes up to this mass (1: off)",
    "temperature": "the talker's sampling temperature",
    "repetition_penalty": "divide the scores of codes the talker already spoke (1: off)",
    "subtalker_dosample": "sample the code predictor's codes (false: the likeliest each step)",
    "subtalker_top_k": "the code predictor samples among this many likeliest codes (0: off)",
    "subtalker_top_p": "the code predictor's nucleus sampling (1: off)",
    "subtalker_temperature": "the code predictor's sampling temperature",
    "max_new_tokens": "the most talker steps (frames + 1 at 12.5 Hz)",
}


def _sampling_options(defaults: Mapping[str, Any]) -> tuple[RequestOption, ...]:
    d = {k: defaults.get(k, v) for k, v in HARD_DEFAULTS.items()}
    return (
        RequestOption("do_sample", "bool", bool(d["do_sample"]), _HELP["do_sample"]),
        RequestOption("temperature", "float", float(d["temperature"]), _HELP["temperature"], 0.01, 5.0),
        RequestOption("top_k", "int", int(d["top_k"]), _HELP["top_k"], 0, 100000),
        RequestOption("top_p", "float", float(d["top_p"]), _HELP["top_p"], 0.0, 1.0),
        RequestOption("repetition_penalty", "float", float(d["repetition_penalty"]), _HELP["repetition_penalty"],
                      0.01, 10.0),
        RequestOption("subtalker_dosample", "bool", bool(d["subtalker_dosample"]), _HELP["subtalker_dosample"]),
        RequestOption("subtalker_temperature", "float", float(d["subtalker_temperature"]),
                      _HELP["subtalker_temperature"], 0.01, 5.0),
        RequestOption("subtalker_top_k", "int", int(d["subtalker_top_k"]), _HELP["subtalker_top_k"], 0, 100000),
        RequestOption("subtalker_top_p", "float", float(d["subtalker_top_p"]), _HELP["subtalker_top_p"], 0.0, 1.0),
        RequestOption("max_new_tokens", "int", min(int(d["max_new_tokens"]), MOST_NEW_TOKENS),
                      _HELP["max_new_tokens"], 1, MOST_NEW_TOKENS),
    )


def _language(choices: tuple[str, ...]) -> RequestOption:
    return RequestOption("language", "str", AUTO, "the language spoken (auto: the model's choice)", choices=choices)


def _text_mode(default: bool) -> RequestOption:
    return RequestOption("non_streaming_mode", "bool", default,
                         "the talker reads the whole text before speaking (false: it reads as it speaks)")


def sampling_from(options: Mapping[str, Any]) -> Any:
    """A request's resolved options as the frame loop's `SamplingOptions` (checked as upstream's processors check)."""
    from mizuoto_qwen3tts.generate import SamplingOptions

    return SamplingOptions(**{k: options[k] for k in HARD_DEFAULTS}).checked()


def model_options(layout: ModelLayout) -> tuple[RequestOption, ...]:
    """The request options of a loaded model, with its defaults."""
    return (_language(layout.languages), _text_mode(layout.kind != "base"), *_sampling_options(layout.generation))


# the engine's (before a model is loaded): every option, with the released models' defaults
ENGINE_OPTIONS = (_language(()), _text_mode(False), *_sampling_options({"max_new_tokens": MOST_NEW_TOKENS}))

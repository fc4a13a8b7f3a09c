"""CosyVoice LMs (v1 TransformerLM, v2 Qwen2LM, v3 CosyVoice3LM): upstream's tokens for every LM case."""

import functools
from pathlib import Path

import pytest
import torch

from mizuoto.engines.cosyvoice.llm import V1_VARIANT, VARIANTS, build_lm, drop_silent_runs, load_lm, load_lm_state
from mizuoto.errors import InvalidRequest, MizuotoError, ModelLoadError
from mizuoto.runtime.hyperyaml import load_hyperyaml
from mizuoto.testing.cosyvoice_cases import bistream_text, list_cases, load_case


@functools.cache
def _yaml(path: Path) -> dict:
    return load_hyperyaml(path)


def _lm_class(ref) -> str:
    return _yaml(ref.yaml_path)["llm"].cls


# an LM case records the LM's tokens and has text to speak (voice conversion has neither)
LM_CASES = [r for r in list_cases() if r.has("lm.tokens_raw", "input.text")]
MODEL_DIRS = sorted({r.model_dir for r in list_cases()})
QWEN_MODEL_DIRS = sorted({r.model_dir for r in list_cases() if _lm_class(r) in VARIANTS})


def test_cases_were_found():
    assert LM_CASES and QWEN_MODEL_DIRS
    assert {_lm_class(r) for r in LM_CASES} <= set(VARIANTS) | {V1_VARIANT}


@functools.cache
def _lm(model_dir: Path):
    yaml_path = next(r.yaml_path for r in list_cases() if r.model_dir == model_dir)
    return load_lm(model_dir, _yaml(yaml_path))


def _generate(lm, case, generator, cache="dynamic") -> list[int]:
    return list(lm.generate(case.input("text"), case.input("prompt_text"), case.input("llm_prompt_speech_token"),
                            generator=generator, embedding=case.input("llm_embedding"), cache=cache))


@pytest.mark.parametrize("ref", LM_CASES, ids=lambda r: r.id)
def test_tokens_equal_upstream(ref):
    case = load_case(ref)
    lm = _lm(case.model_dir)
    expected = case["lm.tokens_raw"].tolist()
    # v1's wenet LM has one (growing) cache; the Qwen LMs must agree with either cache
    for cache in ("dynamic", "static") if _lm_class(ref) in VARIANTS else ("dynamic",):
        assert _generate(lm, case, torch.Generator().manual_seed(case.seed), cache) == expected, cache


def test_global_generator_draws_the_same():
    # upstream drew from the global generator after set_all_random_seed(seed)
    ref = min(LM_CASES, key=lambda r: r.json_path.stat().st_size)
    case = load_case(ref)
    torch.manual_seed(case.seed)
    assert _generate(_lm(case.model_dir), case, None) == case["lm.tokens_raw"].tolist()


@pytest.mark.parametrize("ref", [r for r in LM_CASES if _lm_class(r) == "CosyVoice3LM"],
                         ids=lambda r: r.id)
def test_v3_silent_runs_dropped_before_flow(ref):
    """The recorded flow tokens are the raw LM tokens after the filter (no fixture has a run longer
    than five, so the rule itself is checked on constructed streams below and in test_end_to_end)."""
    case = load_case(ref)
    last_flow = max(int(k.split(".")[1]) for k in case.tensors if k.startswith("flow.") and k.endswith(".token"))
    filtered = list(drop_silent_runs(case["lm.tokens_raw"].tolist()))
    assert filtered == case[f"flow.{last_flow}.token"].flatten().tolist()


# Upstream's definition, written out here rather than read from the implementation: at ace7c47,
# CosyVoice3Model.__init__ sets silent_tokens to these FSQ ids ("silent and breath" tokens), and
# llm_job counts consecutive tokens from that list, keeps the first five of a run (max 5) and
# skips the rest; any other token resets the count. The count keeps rising over skipped tokens.
UPSTREAM_V3_SILENT = (1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323)
UPSTREAM_MAX_SILENT = 5


def _upstream_llm_job(tokens: list[int]) -> list[int]:
    kept, run = [], 0
    for t in tokens:
        if t in UPSTREAM_V3_SILENT:
            run += 1
            if run > UPSTREAM_MAX_SILENT:
                continue
        else:
            run = 0
        kept.append(t)
    return kept


def test_drop_silent_runs_keeps_five_of_a_run_of_upstreams_silent_ids():
    s = UPSTREAM_V3_SILENT
    # a run of exactly five is kept whole; the sixth and later of a run are dropped
    assert list(drop_silent_runs([7, *s[:5], 8])) == [7, *s[:5], 8]
    assert list(drop_silent_runs([7, *s, 8])) == [7, *s[:5], 8]
    # a run may start the stream, end it, and mix any of the ids (the last s[10] opens a run of seven)
    assert list(drop_silent_runs([s[3]] * 9)) == [s[3]] * 5
    assert list(drop_silent_runs([9, s[10]] * 2 + [s[0]] * 6)) == [9, s[10], 9, s[10], *[s[0]] * 4]
    # a non-silent token resets the count; silence of any length before it does not carry over
    assert list(drop_silent_runs([*s[:6], 100, *s[5:]])) == [*s[:5], 100, *s[5:10]]
    # every listed id counts as silent: seven of one id keep five
    for sid in s:
        assert list(drop_silent_runs([0, *[sid] * 7, 0])) == [0, *[sid] * 5, 0], sid
    # ids next to the listed ones are speech
    speech = [0, 3, 27, 30, 54, 56, 247, 249, 493, 495, 2240, 2243, 2321, 2324, 6560]
    assert list(drop_silent_runs(speech * 2)) == speech * 2


def test_drop_silent_runs_equals_upstreams_rule_on_random_streams():
    """Streams dense in silent ids (half of the draws), against llm_job's rule written out above."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(0, 60, (1,), generator=gen))
        silent = torch.tensor(UPSTREAM_V3_SILENT)[torch.randint(0, len(UPSTREAM_V3_SILENT), (n,), generator=gen)]
        speech = torch.randint(0, 6561, (n,), generator=gen)
        tokens = torch.where(torch.rand(n, generator=gen) < 0.5, silent, speech).tolist()
        assert list(drop_silent_runs(iter(tokens))) == _upstream_llm_job(tokens), tokens


@pytest.mark.parametrize("model_dir", QWEN_MODEL_DIRS, ids=lambda p: p.parent.name)
def test_sizes_from_yaml_and_config(model_dir):
    lm = _lm(model_dir)
    node = _yaml(next(r.yaml_path for r in list_cases() if r.model_dir == model_dir))["llm"]
    n = node["speech_token_size"]
    extra = 3 if node.cls == "Qwen2LM" else 200
    assert lm.speech_embedding.weight.shape == (n + extra, node["llm_input_size"])
    assert lm.llm_decoder.weight.shape == (n + extra, node["llm_output_size"])
    assert (lm.llm_decoder.bias is not None) == (node.cls == "Qwen2LM")
    assert hasattr(lm, "llm_embedding") == (node.cls == "Qwen2LM")
    assert lm.sampler.top_k == node["sampling"]["top_k"] and lm.sampler.top_p == node["sampling"]["top_p"]


def _state(model_dir: Path) -> dict:
    return torch.load(model_dir / "llm.pt", map_location="cpu", weights_only=True)


@pytest.mark.parametrize("model_dir", MODEL_DIRS, ids=lambda p: p.parent.name)
def test_load_errors_name_the_keys(model_dir, tmp_path):
    yaml_path = next(r.yaml_path for r in list_cases() if r.model_dir == model_dir)
    node = _yaml(yaml_path)["llm"]
    sd = _state(model_dir)
    broken = tmp_path / "llm.pt"

    def fails(state, match):
        torch.save(state, broken)
        with pytest.raises(ModelLoadError, match=match):
            load_lm_state(build_lm(node, model_dir), broken)

    key = sorted(k for k in sd if k.startswith("llm.") and "lm_head" not in k and "embed" not in k
               and sd[k].dim() == 2)[0]
    fails({k: v for k, v in sd.items() if k != key}, f"missing keys: {key}")
    fails(dict(sd, **{"llm.extra.weight": torch.zeros(1)}), "unexpected keys: llm.extra.weight")
    fails(dict(sd, **{key: sd[key][:, :-1].clone()}), f"{key} has shape")
    if node.cls in VARIANTS and build_lm(node, model_dir).llm.lm_head is None:  # the config ties the head
        fails({k: v for k, v in sd.items() if k != "llm.model.lm_head.weight"}, "lm_head")
        fails(dict(sd, **{"llm.model.lm_head.weight": sd["llm.model.lm_head.weight"] + 1}), "tied")
    broken.write_bytes((model_dir / "llm.pt").read_bytes()[:4096])
    with pytest.raises(ModelLoadError, match="cannot read"):
        load_lm_state(build_lm(node, model_dir), broken)
    with pytest.raises(ModelLoadError, match="missing"):
        load_lm_state(build_lm(node, model_dir), tmp_path / "absent.pt")


def test_v3_needs_endofprompt():
    ref = next(r for r in LM_CASES if _lm_class(r) == "CosyVoice3LM")
    lm = _lm(ref.model_dir)
    with pytest.raises(InvalidRequest, match="endofprompt"):
        next(lm.generate(torch.tensor([[10, 11, 12]], dtype=torch.int32), generator=torch.Generator()))


def _bistream(lm, pieces, case, cache="dynamic", seed=7, consumed=None):
    """Tokens (and, if the LM stops on a special token as upstream does, that error's text)."""
    def feed():
        for i, piece in enumerate(pieces):
            if consumed is not None:
                consumed.append(i)
            yield piece
    out = []
    try:
        for token in lm.generate_bistream(feed(), case.input("prompt_text"), case.input("llm_prompt_speech_token"),
                                          generator=torch.Generator().manual_seed(seed), cache=cache, cache_len=4096):
            out.append((token, len(consumed) if consumed is not None else None))
    except MizuotoError as exc:
        out.append((str(exc), len(consumed) if consumed is not None else None))
    return out


def _long_text(case, lm, piece: int) -> torch.Tensor:
    """The case's text, long enough that the LM speaks before it ends (bistream_text)."""
    return bistream_text(case.input("text"), case.input("prompt_text"), case.input("llm_prompt_speech_token").shape[1],
                         piece, lm.mix_ratio)


def _bistream_case(ref_filter):
    """One case per model whose LM class passes the filter, with a reference text and tokens."""
    refs = {}
    for r in LM_CASES:
        if ref_filter(_lm_class(r)) and r.has("input.prompt_text", "input.llm_prompt_speech_token"):
            refs.setdefault(r.model_dir, r)
    return list(refs.values())


@pytest.mark.parametrize("ref", _bistream_case(lambda c: c in VARIANTS), ids=lambda r: r.id)
def test_bistream_is_deterministic_and_cache_independent(ref):
    case = load_case(ref)
    lm = _lm(case.model_dir)
    text = _long_text(case, lm, 3)
    pieces = [text[:, i:i + 3] for i in range(0, text.shape[1], 3)]
    first = _bistream(lm, pieces, case)
    assert first, "the LM neither spoke nor stopped with an error"  # eos first is an empty list
    assert first == _bistream(lm, pieces, case) == _bistream(lm, pieces, case, cache="static")


@pytest.mark.parametrize("ref", _bistream_case(lambda c: c == "Qwen2LM"), ids=lambda r: r.id)
def test_bistream_speaks_while_text_arrives(ref):
    case = load_case(ref)
    lm = _lm(case.model_dir)
    text = _long_text(case, lm, 2)
    pieces = [text[:, i:i + 2] for i in range(0, text.shape[1], 2)]
    consumed: list[int] = []
    out = _bistream(lm, pieces, case, consumed=consumed)
    # the first thing the LM did (a token, or a special token upstream rejects too) came early
    assert out and out[0][1] < len(pieces), "the LM did nothing before the text iterator was exhausted"


@pytest.mark.parametrize("model_dir", QWEN_MODEL_DIRS, ids=lambda p: p.parent.name)
def test_bistream_needs_reference_text(model_dir):
    lm = _lm(model_dir)
    with pytest.raises(InvalidRequest, match="reference text"):
        next(lm.generate_bistream(iter([torch.tensor([[5, 6]])]), torch.zeros(1, 0, dtype=torch.int32)))
    if lm.variant == "CosyVoice3LM":
        with pytest.raises(InvalidRequest, match="endofprompt"):
            next(lm.generate_bistream(iter([torch.tensor([[5, 6]])]), torch.tensor([[7, 8]])))


def test_static_cache_length_is_checked_up_front():
    ref = next(r for r in LM_CASES if _lm_class(r) in VARIANTS)
    case = load_case(ref)
    lm = _lm(case.model_dir)
    args = (case.input("text"), case.input("prompt_text"), case.input("llm_prompt_speech_token"))
    with pytest.raises(InvalidRequest, match="too small"):
        next(lm.generate(*args, generator=torch.Generator(), cache="static", cache_len=8))
    tokens = list(lm.generate(*args, generator=torch.Generator().manual_seed(case.seed), cache="static",
                              cache_len=4096))
    assert tokens == case["lm.tokens_raw"].tolist()

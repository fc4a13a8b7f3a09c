"""T3 against upstream chatterbox-tts 0.1.7: conditioning rows and every draw, torch.equal, on every recorded case."""

import pytest
import torch


def test_conditioning_rows_equal_upstreams(case):
    ref = case.tensors()
    model = case.t3()
    cond = model.conditioning(ref["t3_cond_speaker_emb"], ref["t3_cond_prompt_speech_tokens"],
                              float(ref["t3_cond_emotion_adv"].flatten()[0]))
    case.assert_equal(cond, "t3_cond_emb")


def test_every_draw_equals_upstreams(case):
    ref = case.tensors()
    model = case.t3()
    text = ref["text_tokens"][0].long()
    if "expected_error" in case.spec:  # upstream fails (English without guidance): a clear error here
        with pytest.raises(ValueError, match="cfg_weight"):
            next(model.generate(ref["t3_cond_emb"], text, case.t3_options()))
        return
    torch.manual_seed(case.spec["seed"])
    run = model.generate_turbo if model.turbo else model.generate
    drawn = list(run(ref["t3_cond_emb"], text, case.t3_options()))
    case.assert_equal(torch.tensor(drawn), "t3_sampled_tokens")


def test_the_static_cache_gives_the_dynamic_caches_numbers(case):
    """T3's unbatched path writes a static KV cache; upstream's grows by concatenation: the same outputs."""
    from mizuoto.nn.lm.kv_cache import StaticKVCache

    t3 = case.t3()
    cfg = t3.tfmr.config
    g = torch.Generator().manual_seed(0)
    rows = 1 if t3.turbo else 2
    x = torch.randn(rows, 40, cfg.hidden_size, generator=g)
    with torch.inference_mode():
        dynamic = t3.tfmr.new_cache()
        static = StaticKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 60, batch=rows)
        assert torch.equal(t3.tfmr(x, dynamic), t3.tfmr(x, static))
        for _ in range(8):
            step = torch.randn(rows, 1, cfg.hidden_size, generator=g)
            assert torch.equal(t3.tfmr(step, dynamic), t3.tfmr(step, static))


def test_a_turbo_decode_that_reaches_the_position_table_fails_clearly(case):
    """Upstream fails on GPT-2's position table there; a prompt past the table is refused before any pass."""
    from mizuoto.errors import InvalidRequest

    t3 = case.t3()
    if not t3.turbo:
        return
    ref = case.tensors()
    cond, positions = ref["t3_cond_emb"], t3.tfmr.config.max_positions
    room = 3  # speech positions left after the prompt (conditioning, text, speech start)
    text = torch.zeros(positions - cond.shape[1] - 1 - room, dtype=torch.long)
    draws = t3.generate_turbo(cond, text, case.t3_options(), generator=torch.Generator().manual_seed(0),
                              ban_stop=True)
    assert len([next(draws) for _ in range(room + 1)]) == room + 1  # the last draw needs no pass
    with pytest.raises(InvalidRequest, match="ran past this model's"):
        next(draws)
    with pytest.raises(InvalidRequest, match="too long for this model"):
        next(t3.generate_turbo(cond, torch.zeros(positions, dtype=torch.long), case.t3_options()))

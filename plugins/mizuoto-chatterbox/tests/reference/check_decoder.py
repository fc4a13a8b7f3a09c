"""Mizuoto's decoder (mizuoto.nn.lm.decoder) against transformers 5.2.0's LlamaModel and GPT2Model, in the
reference environment: random weights, a 37-position prefill then 20 single-position steps, torch.equal.

    /work/cbref/bin/python plugins/mizuoto-chatterbox/tests/reference/check_decoder.py

Also shows what a batched T3 must keep: at batch 2 (a request's cond/uncond pair) upstream attends
over both rows in one SDPA call, and SDPA on the CPU rounds a batch of 2 differently from two calls of
1 once the cache is long enough, so `Decoder.step_rows` (one call per row) is not the pair's step.
"""

import sys
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2Model, LlamaConfig, LlamaModel

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))  # the repository root: mizuoto, not installed here
from mizuoto.nn.lm.decoder import Decoder, DecoderConfig  # noqa: E402
from mizuoto.runtime.convert.checkpoint import DictSource, match_state_dict  # noqa: E402

LLAMA = dict(vocab_size=8, max_position_embeddings=131072, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=4, attn_implementation="sdpa", head_dim=16, tie_word_embeddings=False,
             hidden_act="silu", attention_bias=False, mlp_bias=False, model_type="llama", num_key_value_heads=4,
             rms_norm_eps=1e-5, rope_theta=500000.0,
             rope_scaling=dict(factor=8.0, high_freq_factor=4.0, low_freq_factor=1.0,
                               original_max_position_embeddings=8192, rope_type="llama3"))
GPT2 = dict(activation_function="gelu_new", n_embd=48, n_head=4, n_layer=3, n_positions=256, vocab_size=30,
            layer_norm_epsilon=1e-5, model_type="gpt2")


def pair(upstream: torch.nn.Module, config: dict) -> Decoder:
    """The decoder with the upstream module's random weights, matched by name and shape."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in upstream.parameters():
            p.copy_(torch.randn(p.shape) * 0.2)
    upstream.eval()
    ours = Decoder(DecoderConfig.from_dict(config)).eval()
    state, keys = upstream.state_dict(), ours.upstream_keys()
    shapes = {k: v.shape for k, v in ours.state_dict().items() if not k.startswith("lm_head.")}
    ignore = [k for k in state if k not in set(keys.values())]
    ours.load_state_dict(match_state_dict(DictSource(state), keys, shapes, where="upstream", target="the decoder",
                                          ignore=ignore), strict=False)
    return ours


@torch.inference_mode()
def check(name: str, upstream: torch.nn.Module, config: dict, batch: int, per_row: bool = False) -> bool:
    ours = pair(upstream, config)
    hidden = upstream.config.hidden_size
    x = torch.randn(batch, 37, hidden)
    out = upstream(inputs_embeds=x, use_cache=True)
    past = out.past_key_values
    caches = [ours.new_cache() for _ in range(batch)] if per_row else [ours.new_cache()]
    if per_row:
        mine = torch.cat([ours(x[r:r + 1], c) for r, c in enumerate(caches)])
    else:
        mine = ours(x, caches[0])
    equal = [torch.equal(out.last_hidden_state, mine)]
    for _ in range(20):
        y = torch.randn(batch, 1, hidden)
        out = upstream(inputs_embeds=y, past_key_values=past, use_cache=True)
        past = out.past_key_values
        mine = ours.step_rows(y, caches) if per_row else ours(y, caches[0])
        equal.append(torch.equal(out.last_hidden_state, mine))
    how = "step_rows, one cache per row" if per_row else "forward"
    print(f"{name} batch {batch} ({how}): prefill {'equal' if equal[0] else 'DIFFERS'}, "
          f"{sum(equal[1:])} of 20 steps equal")
    return all(equal)


if __name__ == "__main__":
    torch.set_num_threads(2)
    ok = True
    for batch in (1, 2):
        ok &= check("llama", LlamaModel(LlamaConfig(**LLAMA)), LLAMA, batch)
        ok &= check("gpt2", GPT2Model(GPT2Config(**GPT2)), GPT2, batch)
    for name, model, config in (("llama", LlamaModel(LlamaConfig(**LLAMA)), LLAMA),
                                ("gpt2", GPT2Model(GPT2Config(**GPT2)), GPT2)):
        check(name, model, config, 2, per_row=True)  # expected to differ: see the docstring
    sys.exit(0 if ok else 1)

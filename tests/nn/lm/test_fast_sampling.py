"""The on-device sampler draws upstream's tokens and leaves the generator where upstream leaves it.

The reference is a transcription of upstream's loop (CosyVoice cosyvoice/utils/common.py at
ace7c47f: nucleus_sampling, random_sampling, ras_sampling), kept here only: the global
generator, the Python loop growing 0-d sums in the score dtype, the kept probabilities rebuilt
with torch.tensor, then multinomial(1, replacement=True).
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from mizuoto.nn.lm.sampling import FastSampler, nucleus_draw, nucleus_keep, ras_draw

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TOP_P, TOP_K = 0.8, 25
VOCAB = 512  # the sort is the same op at any size; the real vocabulary is tested below
REAL_VOCAB = 6564  # CosyVoice 2: 6561 speech tokens + 3 stop ids
SEEDS_PER_N = 20


# --- upstream's samplers, transcribed (global generator, as upstream draws) -------------------

def upstream_nucleus(weighted_scores, top_p=0.8, top_k=25, kept=None):
    prob, indices = [], []
    cum_prob = 0.0
    sorted_value, sorted_idx = weighted_scores.softmax(dim=0).sort(descending=True, stable=True)
    for i in range(len(sorted_idx)):
        if cum_prob < top_p and len(prob) < top_k:
            cum_prob += sorted_value[i]
            prob.append(sorted_value[i])
            indices.append(sorted_idx[i])
        else:
            break
    if kept is not None:
        kept.append(len(prob))  # test bookkeeping only
    prob = torch.tensor(prob).to(weighted_scores)
    indices = torch.tensor(indices, dtype=torch.long).to(weighted_scores.device)
    return indices[prob.multinomial(1, replacement=True)].item()


def upstream_random(weighted_scores, decoded_tokens, sampling):
    return weighted_scores.softmax(dim=0).multinomial(1, replacement=True).item()


def upstream_ras(weighted_scores, decoded_tokens, sampling, top_p=0.8, top_k=25, win_size=10, tau_r=0.1):
    top_ids = upstream_nucleus(weighted_scores, top_p=top_p, top_k=top_k)
    rep_num = (torch.tensor(decoded_tokens[-win_size:]).to(weighted_scores.device) == top_ids).sum().item()
    if rep_num >= win_size * tau_r:
        weighted_scores[top_ids] = -float('inf')
        top_ids = upstream_random(weighted_scores, decoded_tokens, sampling)
    return top_ids


# --- score vectors whose nucleus is n long -------------------------------------------------------

def scores_for(target: int, dtype: torch.dtype, count: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    """`count` log-probability rows whose nucleus (top_p 0.8) is about `target` long.

    The first target - 1 probabilities sum to a little under 0.8 and the first target to a
    little over; target 25 spreads 0.6 over 40 tokens, so that only the top_k cap stops the loop.
    """
    g = torch.Generator().manual_seed(1000 * target + seed)
    head, mass = (target, min(0.9, 0.8 + 0.4 / target)) if target < TOP_K else (40, 0.6)
    jitter = 1 + 0.06 * (torch.rand(count, head, generator=g, dtype=torch.float64) - 0.5)
    p_head = (mass / head * jitter).sort(dim=1, descending=True).values
    spread = 0.5 + torch.rand(count, vocab - head, generator=g, dtype=torch.float64)
    tail = (1 - p_head.sum(1, keepdim=True)) / (vocab - head) * spread
    probs = torch.cat([p_head, torch.minimum(tail, p_head[:, -1:])], dim=1)
    order = torch.rand(count, vocab, generator=g).argsort(dim=1)  # a random place for each token
    logits = torch.empty_like(probs).scatter_(1, order, probs.log())
    return logits.log_softmax(1).to(dtype)


def cases(dtype: torch.dtype):
    """(scores, n) with at least SEEDS_PER_N vectors for every nucleus size n in 1..25."""
    by_n: dict[int, list[torch.Tensor]] = {n: [] for n in range(1, TOP_K + 1)}
    for target in range(1, TOP_K + 1):
        for scores in scores_for(target, dtype, 2 * SEEDS_PER_N):
            kept = []
            upstream_nucleus(scores.clone(), TOP_P, TOP_K, kept)  # only to learn n
            if len(by_n[kept[0]]) < SEEDS_PER_N:
                by_n[kept[0]].append(scores)
    short = {n: len(v) for n, v in by_n.items() if len(v) < SEEDS_PER_N}
    assert not short, f"{dtype}: too few score vectors for nucleus sizes {short}"
    return [(s, n) for n, v in by_n.items() for s in v]


@pytest.fixture(scope="module", params=DTYPES, ids=lambda d: str(d).split(".")[-1])
def dtype_cases(request):
    return request.param, cases(request.param)


# --- tests ---------------------------------------------------------------------------------------

def test_every_nucleus_size_and_dtype_draws_upstreams_token_and_leaves_its_generator_state(dtype_cases):
    dtype, all_cases = dtype_cases
    sizes = Counter()
    for i, (scores, n) in enumerate(all_cases):
        torch.manual_seed(i)
        kept = []
        want = upstream_nucleus(scores.clone(), TOP_P, TOP_K, kept)
        want_state = torch.get_rng_state()
        assert kept == [n]

        torch.manual_seed(i)  # the default generator, as upstream
        got = nucleus_draw(scores.clone(), None, TOP_P, TOP_K, fixed_draws=False)
        assert got.dtype == torch.long and got.dim() == 0
        assert int(got) == want, (dtype, n, i)
        assert torch.equal(torch.get_rng_state(), want_state), (dtype, n, i)

        g = torch.Generator().manual_seed(i)  # an explicit generator: the same stream
        assert int(nucleus_draw(scores.clone(), g, TOP_P, TOP_K)) == want
        assert torch.equal(g.get_state(), want_state)

        # The CUDA path draws top_k exponentials whatever n is. On the CPU that gives upstream's
        # token, and the generator ends where upstream's would after top_k - n more exponential
        # draws: the n-element draw is exactly the first n of the top_k-element one.
        g = torch.Generator().manual_seed(i)
        assert int(nucleus_draw(scores.clone(), g, TOP_P, TOP_K, fixed_draws=True)) == want, (dtype, n, i)
        torch.empty(TOP_K - n, dtype=dtype).exponential_(1)
        assert torch.equal(g.get_state(), torch.get_rng_state()), (dtype, n, i)
        sizes[n] += 1
    assert all(sizes[n] >= SEEDS_PER_N for n in range(1, TOP_K + 1)), sizes


def upstream_loop_length(sorted_value, top_p=0.8, top_k=25):
    """How many sorted probabilities upstream's loop keeps (its body, on given sorted values)."""
    prob, cum_prob = [], 0.0
    for i in range(len(sorted_value)):
        if cum_prob < top_p and len(prob) < top_k:
            cum_prob += sorted_value[i]
            prob.append(sorted_value[i])
        else:
            break
    return len(prob)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_nucleus_keep_on_the_top_p_boundary(dtype):
    # running sums that land exactly on top_p as the dtype rounds it, or one step either side
    boundary = torch.tensor(TOP_P, dtype=dtype)
    for step in (-1, 0, 1):
        target = torch.nextafter(boundary, torch.tensor(step * 2.0, dtype=dtype)) if step else boundary
        for first in (0.5, 0.25):
            head = torch.tensor([first], dtype=dtype)
            rest = (target - head).to(dtype)
            values = torch.cat([head, rest.reshape(1), torch.full((30,), 0.001, dtype=dtype)])
            values = values.sort(descending=True).values
            n = upstream_loop_length(values)
            keep = nucleus_keep(values[:TOP_K], TOP_P)
            assert keep.tolist() == [True] * n + [False] * (TOP_K - n), (dtype, step, first)


def test_nucleus_keep_is_the_loops_prefix(dtype_cases):
    dtype, all_cases = dtype_cases
    for scores, n in all_cases[::7]:
        values = scores.softmax(0).sort(descending=True, stable=True).values[:TOP_K]
        keep = nucleus_keep(values, TOP_P)
        assert keep.tolist() == [True] * n + [False] * (TOP_K - n)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_ras_redraw_after_a_repetition_is_upstreams(dtype):
    redraws = 0
    for i in range(60):
        scores = scores_for(1 + i % TOP_K, dtype, 1, seed=i)[0]
        torch.manual_seed(i)
        first = upstream_nucleus(scores.clone(), TOP_P, TOP_K)
        # alternate: the drawn token in the window (redraw), only older than the window, absent
        decoded = [[7, first, 9], [first] + [11] * 10, [3, 4]][i % 3]
        ours, theirs = scores.clone(), scores.clone()
        torch.manual_seed(i)
        want = upstream_ras(theirs, decoded, 25, TOP_P, TOP_K, 10, 0.1)
        want_state = torch.get_rng_state()
        g = torch.Generator().manual_seed(i)
        got = ras_draw(ours, decoded, g, TOP_P, TOP_K, 10, 0.1)
        assert got == want and torch.equal(g.get_state(), want_state), (i, decoded)
        assert torch.equal(ours, theirs)  # the -inf written into the scores, as upstream
        redraws += i % 3 == 0
    assert redraws > 0


def test_fast_sampler_is_a_drop_in():
    sampler = FastSampler.like(SimpleNamespace(kind="ras_sampling", top_p=0.8, top_k=25, win_size=10, tau_r=0.1))
    scores = scores_for(5, torch.float32, 1)[0]
    torch.manual_seed(4)
    want = upstream_ras(scores.clone(), [1, 2], 25)
    g = torch.Generator().manual_seed(4)
    assert sampler(scores.clone(), [1, 2], g) == want

    rand = FastSampler.like(SimpleNamespace(kind="random_sampling"))
    torch.manual_seed(5)
    want = upstream_random(scores.clone(), [], 25)
    assert rand(scores.clone(), [], torch.Generator().manual_seed(5)) == want

    nucleus = FastSampler.like(SimpleNamespace(kind="nucleus_sampling", top_p=0.5, top_k=3))
    torch.manual_seed(6)
    want = upstream_nucleus(scores.clone(), 0.5, 3)
    assert nucleus(scores.clone(), [want] * 10, torch.Generator().manual_seed(6)) == want  # no ras

    with pytest.raises(ValueError, match="no fast path"):
        FastSampler.like(SimpleNamespace(kind="beam"))


def test_small_vocab_and_degenerate_cases():
    # fewer tokens than top_k, and a single token: the loop runs off the end of the vocabulary
    for vocab in (1, 2, 7):
        for seed in range(10):
            scores = torch.randn(vocab, generator=torch.Generator().manual_seed(seed)).log_softmax(0)
            torch.manual_seed(seed)
            want = upstream_nucleus(scores.clone(), 0.99, TOP_K)
            want_state = torch.get_rng_state()
            g = torch.Generator().manual_seed(seed)
            assert int(nucleus_draw(scores.clone(), g, 0.99, TOP_K, fixed_draws=False)) == want
            assert torch.equal(g.get_state(), want_state)
    with pytest.raises(ValueError, match="top_p"):
        nucleus_draw(torch.zeros(4), None, 0.0, TOP_K)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_real_vocabulary_size(dtype):
    for target in (1, 4, 13, 24, 25):
        for i, scores in enumerate(scores_for(target, dtype, 3, vocab=REAL_VOCAB)):
            torch.manual_seed(i)
            want = upstream_nucleus(scores.clone(), TOP_P, TOP_K)
            want_state = torch.get_rng_state()
            g = torch.Generator().manual_seed(i)
            assert int(nucleus_draw(scores.clone(), g, TOP_P, TOP_K, fixed_draws=False)) == want
            assert torch.equal(g.get_state(), want_state)


def test_only_an_upstream_style_sampler_gets_the_fast_form():
    """A sampler whose kind this module knows gets its on-device form; an engine's own draw (no kind, or one
    unknown here) and None stay as they are, never swapped for another distribution."""
    from mizuoto.nn.lm.sampling import FastSampler, SamplerSettings, on_device

    class Own:
        def __call__(self, scores, decoded, generator):
            return 0

    own, odd = Own(), Own()
    odd.kind = "beam_search"
    assert on_device(own) is own and on_device(odd) is odd and on_device(None) is None
    fast = on_device(SamplerSettings(kind="nucleus_sampling", top_p=0.7, top_k=10))
    assert isinstance(fast, FastSampler) and (fast.kind, fast.top_p, fast.top_k) == ("nucleus_sampling", 0.7, 10)

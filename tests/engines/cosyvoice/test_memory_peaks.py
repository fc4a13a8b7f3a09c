"""The planner's flow figures against measured peaks: a short and a long segment on every fixture flow.

The peak is the process's resident memory sampled every millisecond while one flow call runs, over
what it was just before; the planner's figure for the same frames (frames_working_bytes) must be at
least that, and not absurdly more.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from mizuoto.engines.cosyvoice.flow import build_flow, load_flow_weights
from mizuoto.engines.cosyvoice.memory import _attention, _widest, frames_working_bytes
from mizuoto.runtime.hyperyaml import load_hyperyaml
from mizuoto.testing.fixtures import fixtures_root

MODEL_DIRS = sorted(d for d in fixtures_root().glob("cosyvoice/*/model") if next(d.glob("cosyvoice*.yaml"), None))
PROMPT_TOKENS = 50
NOISE_FLOOR = 16 << 20  # below this a resident-memory sample is allocator noise


def test_fixture_flows_were_found():
    assert MODEL_DIRS


def _flow(model_dir: Path):
    config = load_hyperyaml(next(model_dir.glob("cosyvoice*.yaml")))
    return load_flow_weights(build_flow(config), model_dir / "flow.pt")


def _peak(call) -> tuple[int, object]:
    """(bytes the process's resident memory rose by at most during `call()`, its result)."""
    proc = psutil.Process()
    base = proc.memory_info().rss
    peak, stop = [base], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.001)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        out = call()
    finally:
        stop.set()
        watcher.join()
    return peak[0] - base, out


@pytest.mark.parametrize("model_dir", MODEL_DIRS, ids=[d.parent.name for d in MODEL_DIRS])
def test_the_flow_figure_bounds_the_measured_peak(model_dir):
    flow = _flow(model_dir)
    width = _widest(flow)
    heads, copies = _attention(flow)
    assert heads > 0, "the flow's attention was not found"
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 100, (1, PROMPT_TOKENS), generator=g, dtype=torch.int32)
    # prompt mel frames as the front end makes them: two per token (v2/v3); v1's mel rate differs, any length works
    feat = torch.randn(1, 2 * PROMPT_TOKENS, flow.output_size, generator=g)
    embedding = torch.randn(1, flow.spk_embed_affine_layer.in_features, generator=g)
    figures = []
    # one call first: the first one also pays one-time allocations (thread pools, kernel workspaces)
    flow.token2mel(prompt, prompt, feat, embedding, streaming=False, finalize=True, cache=None,
                   generator=torch.Generator())
    for tokens in (40, 400):
        speech = torch.randint(0, 100, (1, tokens), generator=g, dtype=torch.int32)
        grown, (mel, _) = _peak(lambda: flow.token2mel(speech, prompt, feat, embedding, streaming=False,
                                                       finalize=True, cache=None, generator=torch.Generator()))
        frames = mel.shape[2] + feat.shape[1]
        planned = frames_working_bytes(width, heads, copies, frames)
        figures.append((tokens, frames, grown >> 20, planned >> 20))
        assert grown <= planned, f"{tokens} tokens ({frames} frames): measured {grown >> 20} MiB, planned {planned >> 20}"
        assert planned <= 50 * max(grown, NOISE_FLOOR), f"planned {planned >> 20} MiB for {grown >> 20} MiB measured"
    print(f"{model_dir.parent.name}: (tokens, frames, measured MiB, planned MiB) {figures}")

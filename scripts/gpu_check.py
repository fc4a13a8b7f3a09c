"""Issue 8's device checks, in one script: the GPU check to run where a CUDA machine is lent.

Run on a CUDA machine from the repository root (assets from ../shared, or $MIZUOTO_ASSETS):

    python scripts/gpu_check.py                 # all checks, ~3-6 minutes on a current card (estimated)
    python scripts/gpu_check.py --quick         # fewer seeds and tokens (also runs on the CPU)
    python scripts/gpu_check.py --model DIR     # a CosyVoice 2/3 directory instead of the random one

It prints one JSON document (also written to $OUT/gpu_check.json when $OUT is set):
1. sampler: the on-device nucleus draw (fixed top_k exponentials, as decoding uses it on CUDA)
   and its CUDA-graph version against upstream's loop on CUDA, for every nucleus size 1..25,
   fp32/fp16/bf16, many seeds: token and generator state equal.
2. decode: a full-size CosyVoice 2 LM with random weights (sizes from cosyvoice2.yaml and
   CosyVoice-BlankEN/config.json), stop tokens suppressed: tokens of the upstream-style eager
   loop (dynamic cache, upstream sampler), of the on-device sampler with the static cache, and
   of CUDA graphs; equal, also when other draws from the same generator come between tokens
   (as CosyVoice 3's streaming flow does); ms/token of each and the LM step's GB/s.
3. batch: the same model with a continuous batch (`compute.batch`, issue 14): seeded requests
   run together give the same tokens with and without CUDA graphs captured at the batch width
   (`runtime.decode.BatchStep`), with their LM tokens/s; on CUDA, the `--concurrency`
   sweep at 1, 4 and 16 streams (batch width 16) with graphs.
4. bench (CUDA only): `mizuoto bench --random cosyvoice2 --stream` tables without and with
   CUDA graphs (the driver and the random model are mizuoto/engines/cosyvoice/bench.py's).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from mizuoto.engines.cosyvoice.bench import BLANK_EN, build_random_cosyvoice2, lm_step_bytes
from mizuoto.engines.cosyvoice.engine import CosyVoiceEngine
from mizuoto.engines.cosyvoice.llm import ENDOFPROMPT_ID, load_lm
from mizuoto.engines.cosyvoice.variants import find_variant, load_config
from mizuoto.runtime.bench import device_bandwidth_gbs, synchronize
from mizuoto.runtime.graphs import use_cuda_graphs
from mizuoto.runtime.decode import GraphDecodeStep, GraphDraw
from mizuoto.nn.lm.sampling import FastSampler, nucleus_draw
from mizuoto.text.tokenize.qwen import QwenTokenizer

ROOT = Path(__file__).resolve().parents[1]
ASSETS = Path(os.environ.get("MIZUOTO_ASSETS", ROOT.parent / "shared" / "assets"))


# --- a full-size random CosyVoice 2 (written by the engine's bench module) ---------------------

def random_lm(workdir: Path, model_dir: Path | None = None):
    """(lm, tokenizer) of `model_dir`, else of a full-size random CosyVoice 2 written to `workdir`."""
    model_dir = model_dir or build_random_cosyvoice2(workdir / "random-cosyvoice2", ASSETS)
    config = load_config(model_dir, find_variant(model_dir))
    return load_lm(model_dir, config), QwenTokenizer.from_dir(model_dir / BLANK_EN)


class Decoder:
    """CosyVoice 2 decoding for exactly n tokens, stop tokens suppressed, in one of three ways.

    upstream: dynamic cache, the engine's (upstream's) sampler loop, everything eager.
    fast:     static cache, the on-device sampler (one host read per token).
    graphs:   fast + the one-token step and the draw as CUDA graphs (captured once, reused).
    """

    def __init__(self, lm, mode: str, max_positions: int) -> None:
        self.lm, self.mode = lm, mode
        self.head = lambda h: lm.llm_decoder(h[:, -1]).log_softmax(dim=-1).squeeze(0)
        self.sampler = lm.sampler if mode == "upstream" else FastSampler.like(lm.sampler)
        self.cache = None if mode == "upstream" else lm.llm.new_cache("static", max_positions)
        self.step = self.draw = None
        self.graphs = mode == "graphs" and use_cuda_graphs(True, lm.speech_embedding.weight.device, "the LM")

    @torch.inference_mode()
    def __call__(self, lm_input: torch.Tensor, n: int, generator: torch.Generator,
                 between=None, times: list | None = None) -> list[int]:
        lm = self.lm
        kv = lm.llm.new_cache("dynamic") if self.cache is None else self.cache
        kv.reset()
        out: list[int] = []
        x = lm_input
        for i in range(n):
            if self.step is not None and x.shape[1] == 1:
                scores = self.step(x)
            else:
                scores = self.head(lm.llm(x, kv))
                if self.graphs and self.step is None:  # after the first prefill: capture once
                    self.step = GraphDecodeStep(lm.llm, kv, self.head)
                    self.draw = GraphDraw(self.sampler, self.step.output)
            scores[lm.speech_token_size:] = -float("inf")  # a fixed amount of work per request
            sample = self.draw if (self.draw is not None and self.step.captured) else self.sampler
            token = sample(scores, out, generator)
            out.append(token)
            if between is not None:
                between(generator)
            if times is not None:
                times.append(time.perf_counter())
            x = lm.speech_embedding.weight[token].reshape(1, 1, -1)
        return out


def request_input(lm, tokenizer, text: str, prompt_text: str, prompt_tokens: int, device) -> torch.Tensor:
    """The LM input of a clone-style request with `prompt_tokens` random prompt speech tokens."""
    ids = torch.tensor([tokenizer.encode(text)], dtype=torch.int32)
    prompt = tokenizer.encode(prompt_text) if prompt_text else []
    if lm.variant == "CosyVoice3LM":  # its LM input needs the end-of-prompt token
        prompt.append(ENDOFPROMPT_ID)
    pids = torch.tensor([prompt], dtype=torch.int32).reshape(1, -1)
    g = torch.Generator().manual_seed(1)
    ptok = torch.randint(0, lm.speech_token_size, (1, prompt_tokens), generator=g, dtype=torch.int32)
    with torch.inference_mode():
        return lm.lm_input(ids.to(device), pids.to(device), ptok.to(device))


def new_generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


# --- checks ------------------------------------------------------------------------------------

def _sampling_tests():
    path = ROOT / "tests" / "nn" / "lm" / "test_fast_sampling.py"
    spec = importlib.util.spec_from_file_location("fast_sampling_cases", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_sampler(device: torch.device, seeds: int) -> dict:
    """On-device draw (eager and graphed) vs upstream's loop on `device`: tokens and generator state."""
    t = _sampling_tests()
    t.SEEDS_PER_N = seeds
    report = {}
    for dtype in t.DTYPES:
        cases = t.cases(dtype)
        static = torch.zeros(t.VOCAB, dtype=dtype, device=device)
        draw = GraphDraw(FastSampler("nucleus_sampling"), static)
        bad = {"eager": 0, "graph": 0}
        for i, (scores, n) in enumerate(cases):
            s = scores.to(device)
            torch.cuda.manual_seed(i) if device.type == "cuda" else torch.manual_seed(i)
            want = t.upstream_nucleus(s.clone(), t.TOP_P, t.TOP_K)
            want_state = torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()
            g = new_generator(device, i)
            got = int(nucleus_draw(s.clone(), g, t.TOP_P, t.TOP_K, fixed_draws=True))
            if device.type == "cuda":
                bad["eager"] += got != want or not torch.equal(g.get_state(), want_state)
            else:
                bad["eager"] += got != want
            g = new_generator(device, i)
            static.copy_(s)
            got = draw(static, [], g)
            bad["graph"] += got != want or (device.type == "cuda" and not torch.equal(g.get_state(), want_state))
        report[str(dtype).split(".")[-1]] = {"cases": len(cases), "mismatches": bad, "graph_captured": draw.captured}
    return report


def check_decode(device: torch.device, tokens: int, dtypes: list[torch.dtype], workdir: Path,
                 model_dir: Path | None = None) -> dict:
    """Upstream-style vs fast vs graphs on a full-size random CosyVoice 2 LM (or `model_dir`'s)."""
    lm, tok = random_lm(workdir, model_dir)
    text = "Mizuoto measures how fast each stage of a speech model runs on this machine, token by token."
    report: dict = {"tokens": tokens}
    bandwidth, source = device_bandwidth_gbs(device)
    report["device_bandwidth_gb_per_s"], report["device_bandwidth_source"] = bandwidth, source
    for dtype in dtypes:
        lm = lm.to(device=device, dtype=dtype)
        lm_input = request_input(lm, tok, text, "", 75, device)
        positions = lm_input.shape[1] + tokens
        step_bytes = lm_step_bytes(lm, lm_input.shape[1] + tokens / 2)
        row: dict = {"bytes_per_step": step_bytes}
        results = {}
        modes = ["upstream", "fast"] + (["graphs"] if device.type == "cuda" else [])
        for mode in modes:
            dec = Decoder(lm, mode, positions)
            dec(lm_input, 3, new_generator(device, 0))  # warm-up (and capture, for graphs)
            per_token = []
            for rep in range(2):
                times: list[float] = []
                synchronize(device)
                toks = dec(lm_input, tokens, new_generator(device, 0), times=times)
                synchronize(device)
                per_token.append((times[-1] - times[0]) / (len(times) - 1))
            ms = 1e3 * statistics.median(per_token)
            between = lambda g: torch.randn(7, generator=g, device=device)  # noqa: E731
            interleaved = dec(lm_input, min(tokens, 60), new_generator(device, 5), between=between)
            results[mode] = (toks, interleaved)
            row[mode] = {"ms_per_token": ms, "gb_per_s": step_bytes / (ms / 1e3) / 1e9,
                         "bandwidth_fraction": (step_bytes / (ms / 1e3) / 1e9 / bandwidth) if bandwidth else None,
                         "captured": bool(dec.step is not None and dec.step.captured)}
        ref = results["upstream"]
        row["tokens_equal"] = {m: r[0] == ref[0] for m, r in results.items()}
        row["interleaved_tokens_equal"] = {m: r[1] == ref[1] for m, r in results.items()}
        row["first_tokens"] = ref[0][:10]
        report[str(dtype).split(".")[-1]] = row
    return report


def check_batch(device: torch.device, tokens: int, seeds: int, levels: list[int], workdir: Path,
                model_dir: Path | None = None) -> dict:
    """Batched tokens without and with CUDA graphs at the batch width (equal); tokens/s; the sweep."""
    from mizuoto.runtime.bench import BenchSettings, concurrency_sweep
    from mizuoto.runtime.options import parse_options

    width = max(max(levels), seeds)
    settings = BenchSettings(tokens=tokens, runs=1, warmup=1)
    report: dict = {"width": width, "tokens": tokens, "requests": seeds}
    runs = {}
    for graphs in (False, True):
        options = parse_options({"device": str(device), "compute.batch": width,
                                 "compute.cuda_graphs": graphs}).resolved()
        driver = CosyVoiceEngine().bench_driver(model_dir, None if model_dir else "cosyvoice2", options, settings,
                                                workdir, ASSETS)
        driver.use_batch(True)

        def draw(seed: int, driver=driver) -> list[int]:
            return list(driver.synthesizer(tokens).lm_tokens(driver.inputs, new_generator(device, seed)))

        draw(0)  # warm-up: the batch loop starts (and captures its graphs at its first step)
        with ThreadPoolExecutor(seeds) as pool:
            start = time.perf_counter()
            got = list(pool.map(draw, range(seeds)))
            wall = time.perf_counter() - start
        batcher = driver.model.batch_loop()
        mode = "graphs" if graphs else "eager"
        runs[mode] = got
        row = {"lm_tokens_per_s": seeds * tokens / wall, "captured": batcher.batch_step.captured,
               "captures": batcher.batch_step.captures, "batch": batcher.stats()}
        if graphs and device.type == "cuda":
            driver.use_batch(False)
            row["concurrency"] = concurrency_sweep(driver, settings, levels)
        report[mode] = row
        driver.model.close()
        del driver
    report["tokens_equal"] = runs["graphs"] == runs["eager"]
    report["first_tokens"] = [r[:5] for r in runs["eager"]]
    return report


def run_bench_tables(device: torch.device, tokens: int, workdir: Path, model_dir: Path | None = None) -> dict:
    """`mizuoto bench --random cosyvoice2 --stream` on the device: without and with CUDA graphs."""
    from mizuoto.runtime.bench import BenchSettings, benchmark, format_table
    from mizuoto.runtime.options import parse_options

    settings = BenchSettings(tokens=tokens, runs=3, warmup=1, stream=True)
    out = {}
    for graphs in (False, True):
        options = parse_options({"device": str(device), "compute.kv_cache": "static",
                                 "compute.cuda_graphs": graphs}).resolved()
        driver = CosyVoiceEngine().bench_driver(model_dir, None if model_dir else "cosyvoice2", options, settings,
                                                workdir, ASSETS)
        result = benchmark(driver, settings)
        print(format_table(result), file=sys.stderr)
        out["graphs" if graphs else "fast"] = result
        del driver
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="fewer seeds and tokens")
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--skip", action="append", default=[], choices=["sampler", "decode", "batch", "bench"])
    p.add_argument("--concurrency", default="1,4,16", help="the batched sweep's levels (CUDA)")
    p.add_argument("--workdir", help="where the random full-size model is written (reused if there)")
    p.add_argument("--model", type=Path, help="a CosyVoice 2/3 model directory instead of the random full-size one")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    tokens, seeds = (24, 2) if args.quick else (args.tokens, args.seeds)
    report: dict = {"torch": torch.__version__, "device": str(device),
                    "card": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    start = time.perf_counter()
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="gpu-check-"))
    if "sampler" not in args.skip:
        report["sampler"] = check_sampler(device, seeds)
    if "decode" not in args.skip:
        dtypes = [torch.float32] + ([torch.bfloat16] if device.type == "cuda" else [])
        report["decode"] = check_decode(device, tokens, dtypes, workdir, args.model)
    if "batch" not in args.skip:
        levels = [int(c) for c in args.concurrency.split(",")]
        report["batch"] = check_batch(device, tokens, 2 if args.quick else 8, [2] if args.quick else levels, workdir,
                                      args.model)
    if "bench" not in args.skip and device.type == "cuda":
        report["bench"] = run_bench_tables(device, tokens, workdir, args.model)
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    report["seconds"] = time.perf_counter() - start
    text = json.dumps(report, indent=2)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_check.json").write_text(text)
    ok = all(v["mismatches"] == {"eager": 0, "graph": 0} for v in report.get("sampler", {}).values())
    for key, row in report.get("decode", {}).items():
        if isinstance(row, dict) and "tokens_equal" in row:
            ok &= all(row["tokens_equal"].values()) and all(row["interleaved_tokens_equal"].values())
    ok &= report.get("batch", {}).get("tokens_equal", True)
    print("ALL CHECKS PASSED" if ok else "SOME CHECKS FAILED", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""`mizuoto bench` end to end with the CosyVoice driver, on the tiny fixture models (never full size here).

The fixture model dirs are discovered; `--random` is exercised with an assets tree whose
cosyvoice2.yaml and Qwen config.json are a fixture's, so the same code that writes the
full-size model writes (and benches) a small one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from mizuoto.engines.cosyvoice.bench import BLANK_EN, build_random_cosyvoice2
from mizuoto.engines.cosyvoice.engine import CosyVoiceEngine
from mizuoto.engines.cosyvoice.variants import find_variant
from mizuoto.cli import main as cli
from mizuoto.runtime.bench import BenchSettings, loop_groups
from mizuoto.runtime.options import parse_options
from mizuoto.testing.cosyvoice_cases import assemble_model_dir
from mizuoto.testing.fixtures import asset_path, fixtures_root

MODEL_DIRS = sorted(p for p in fixtures_root().glob("cosyvoice/*/model") if p.is_dir() and find_variant(p))
QWEN_DIRS = [p for p in MODEL_DIRS if find_variant(p).version >= 2]
V2_DIRS = [p for p in MODEL_DIRS if find_variant(p).version == 2]
OLD_DIRS = [p for p in MODEL_DIRS if find_variant(p).version < 2]


def test_model_dirs_were_found():
    assert QWEN_DIRS and V2_DIRS and OLD_DIRS


def _bench_json(capsys, argv: list[str]) -> dict:
    assert cli.main(["bench", *argv, "--device", "cpu", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("model_dir", QWEN_DIRS, ids=[p.parent.name for p in QWEN_DIRS])
def test_bench_a_model_dir(capsys, tmp_path, model_dir):
    """`mizuoto bench -m DIR` on an assembled fixture dir: every stage timed, streaming included."""
    dest = assemble_model_dir(model_dir, tmp_path / "model")
    out = _bench_json(capsys, ["-m", str(dest), "--tokens", "6", "--stream"])
    assert out["tokens"] == 6 and out["runs"] == 1 and out["model"].startswith(f"cosyvoice{find_variant(dest).version}")
    assert out["audio_seconds"] > 0 and out["first_chunk_ms"] > 0 and out["lm_ms_per_token"] > 0
    assert out["flow_ms_per_audio_second"] > 0 and out["vocoder_ms_per_audio_second"] > 0
    assert out["lm_bytes_per_step"] > 0 and out["peak_memory_bytes"] > 0
    assert out["options"]["device"] == "cpu"


@pytest.mark.parametrize("model_dir", V2_DIRS[:1], ids=[p.parent.name for p in V2_DIRS[:1]])
def test_bench_concurrency_on_a_fixture_model(capsys, tmp_path, model_dir):
    """`--concurrency 1,2 --threaded`: the rows the issue names, from the loaded model's own synthesizer."""
    dest = assemble_model_dir(model_dir, tmp_path / "model")
    out = _bench_json(capsys, ["-m", str(dest), "--tokens", "6", "--concurrency", "1,2", "--threaded"])
    rows = out["concurrency"]
    assert [r["concurrency"] for r in rows] == [1, 2] and out["thread"].startswith("a worker thread per phase")
    for r in rows:
        assert r["lm_tokens_per_s"] > 0 and r["audio_seconds_per_s"] > 0 and r["peak_memory_bytes"] > 0
        assert 0 < r["first_chunk_p50_ms"] <= r["first_chunk_p95_ms"]
        # where the batch loop's time went: every kind of its work, within the level's wall time
        groups = loop_groups(r["loop_s"])
        assert all(groups[k] > 0 for k in ("steps", "prefill", "flow", "vocoder", "other")), r["loop_s"]
        assert sum(t for k, t in groups.items() if k != "idle") <= r["wall_s"]  # work units are within the level
    # the sweep batches the LM at its widest level unless told otherwise
    assert out["batch_width"] == 2 and out["options"]["batch"] == 2
    alone = _bench_json(capsys, ["-m", str(dest), "--tokens", "6", "--concurrency", "1,2",
                                 "--option", "compute.batch=1"])
    assert alone["batch_width"] == 1
    # one request at a time: the second of two waits for the first, so its first chunk comes later
    rows = alone["concurrency"]
    assert rows[1]["first_chunk_p95_ms"] > rows[0]["first_chunk_p50_ms"]
    assert all(r["loop_s"] == {} for r in rows)  # no batch loop: each request computes in its own thread


@pytest.mark.parametrize("model_dir", QWEN_DIRS, ids=[p.parent.name for p in QWEN_DIRS])
def test_driver_generates_exactly_the_token_count(tmp_path, model_dir):
    """Stop ids are suppressed: a run has exactly `tokens` speech tokens, whatever the weights."""
    dest = assemble_model_dir(model_dir, tmp_path / "model")
    options = parse_options({"device": "cpu", "compute.kv_cache": "static", "compute.cuda_graphs": True}).resolved()
    driver = CosyVoiceEngine().bench_driver(dest, None, options, BenchSettings(tokens=40, runs=1, warmup=0), tmp_path)
    for n in (1, 17, 40):
        tokens = driver.lm(n)
        assert len(tokens) == n and all(0 <= t < driver.model.llm.speech_token_size for t in tokens)
    assert driver.lm(17) == driver.lm(17)  # the same request every run
    mel = driver.flow(driver.lm(9))
    assert mel.dtype == torch.float32 and mel.shape[1] == driver.model.flow.output_size
    assert driver.vocoder(mel).shape[-1] > 0
    chunks = list(driver.stream(40))
    assert len(chunks) >= 2  # 40 tokens stream in more than one chunk


@pytest.mark.parametrize("model_dir", QWEN_DIRS, ids=[p.parent.name for p in QWEN_DIRS])
def test_the_bench_runs_the_functions_a_request_runs(tmp_path, model_dir, monkeypatch):
    """Every timed stage goes through the loaded model's own modules: LM generate, flow token2mel, HiFT vocode."""
    dest = assemble_model_dir(model_dir, tmp_path / "model")
    options = parse_options({"device": "cpu"}).resolved()
    driver = CosyVoiceEngine().bench_driver(dest, None, options, BenchSettings(tokens=8, runs=1, warmup=0), tmp_path)
    model = driver.model
    calls: list[str] = []

    def spy(obj, method):
        real = getattr(obj, method)

        def wrapped(*args, **kwargs):
            calls.append(f"{type(obj).__name__}.{method}")
            return real(*args, **kwargs)
        monkeypatch.setattr(obj, method, wrapped)

    for obj, method in ((model.llm, "generate"), (model.flow, "token2mel"), (model.hift, "vocode")):
        spy(obj, method)
    seen_stages: list[str] = []
    use = model.use

    def traced_use(stage, *rest):
        seen_stages.append(stage)
        return use(stage, *rest)
    monkeypatch.setattr(model, "use", traced_use)
    # the synthesizer a request gets is the one the bench times
    synth = driver.synthesizer(8)
    assert synth.lm is model.llm and synth.flow is model.flow and synth.hift is model.hift
    mel = driver.flow(driver.lm(8))
    driver.vocoder(mel)
    list(driver.stream(8))
    names = {c.split(".")[1] for c in calls}
    assert names == {"generate", "token2mel", "vocode"}, calls
    assert {"llm", "flow", "hift"} <= set(seen_stages)


def _assets_from_fixture(model_dir: Path, root: Path) -> Path:
    """An assets tree whose CosyVoice 2 yaml and Qwen config are the fixture's (the tokenizer is real)."""
    (root / "cosyvoice" / "CosyVoice2-0.5B").mkdir(parents=True)
    shutil.copy(model_dir / "cosyvoice2.yaml", root / "cosyvoice" / "CosyVoice2-0.5B" / "cosyvoice2.yaml")
    blank = root / "cosyvoice" / BLANK_EN
    shutil.copytree(asset_path("cosyvoice", BLANK_EN), blank)
    blank.chmod(0o755)
    (blank / "config.json").unlink()
    shutil.copy(model_dir / BLANK_EN / "config.json", blank / "config.json")
    return root


def test_bench_random_builds_a_model_dir_from_the_assets(capsys, tmp_path):
    """`--random cosyvoice2 --assets A --workdir W`: sizes from A's files, written once to W, benched."""
    assets = _assets_from_fixture(V2_DIRS[0], tmp_path / "assets")
    work = tmp_path / "work"
    argv = ["--random", "cosyvoice2", "--assets", str(assets), "--workdir", str(work), "--tokens", "5"]
    out = _bench_json(capsys, argv)
    assert "random weights" in out["model"] and out["tokens"] == 5
    made = work / "random-cosyvoice2"
    assert {"cosyvoice2.yaml", "llm.pt", "flow.pt", "hift.pt"} <= {p.name for p in made.iterdir()}
    # the written checkpoints are upstream's format: the engine's strict loaders took them
    want = torch.load(V2_DIRS[0] / "llm.pt", map_location="cpu", weights_only=True)
    got = torch.load(made / "llm.pt", map_location="cpu", weights_only=True)
    assert {k: tuple(v.shape) for k, v in got.items()} == {k: tuple(v.shape) for k, v in want.items()}
    stamp = (made / "llm.pt").stat().st_mtime_ns
    _bench_json(capsys, argv)
    assert (made / "llm.pt").stat().st_mtime_ns == stamp  # reused, not rewritten


def test_random_needs_the_assets(tmp_path):
    with pytest.raises(Exception, match="cosyvoice2.yaml"):
        build_random_cosyvoice2(tmp_path / "m", assets=tmp_path)


@pytest.mark.parametrize("model_dir", OLD_DIRS, ids=[p.parent.name for p in OLD_DIRS])
def test_cosyvoice1_is_benched_too(capsys, tmp_path, model_dir):
    """Its wenet LM speaks exactly the tokens asked for (stop suppressed), as the Qwen2 LMs do."""
    dest = assemble_model_dir(model_dir, tmp_path / "model")
    assert cli.main(["bench", "-m", str(dest), "--device", "cpu", "--tokens", "12", "--runs", "1",
                     "--warmup", "0", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model"].startswith("cosyvoice1") and result["lm_ms_per_token"] > 0 and result["audio_seconds"] > 0


def test_bench_is_a_registered_command():
    assert "bench" in cli.COMMANDS
    args = cli.build_parser().parse_args(["bench", "--random", "cosyvoice2", "--json"])
    assert args.random == "cosyvoice2" and args.json


@pytest.mark.parametrize("order", ["exact", "fast"])
def test_bench_times_a_new_voice_and_the_same_clip_again(capsys, tmp_path, order):
    """`--reference CLIP`: the voice prompt of a clip never seen (CAM++ runs) and of the same clip again
    (its embedding kept), under the compute.reference the model was loaded with."""
    manifest = json.loads((fixtures_root() / "frontend" / "manifest.json").read_text())
    clip = fixtures_root() / "frontend" / next(iter(manifest["clips"].values()))["wav"]
    dest = assemble_model_dir(QWEN_DIRS[0], tmp_path / "model")
    out = _bench_json(capsys, ["-m", str(dest), "--tokens", "2", "--reference", str(clip),
                               "--option", f"compute.reference={order}"])
    assert out["reference_order"] == f"compute.reference={order}" and out["reference_seconds"] > 0
    assert out["reference_new_ms"] > 0 and 0 < out["reference_again_ms"]
    if order == "exact":  # the exact CAM++ is the bulk of a new voice; again it is skipped
        assert out["reference_again_ms"] < out["reference_new_ms"]
    assert cli.main(["bench", "-m", str(dest), "--device", "cpu", "--tokens", "2", "--reference", str(dest / "llm.pt")]) != 0
    assert "not an audio file" in capsys.readouterr().err

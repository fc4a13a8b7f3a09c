"""scripts/gpu_check.py, the device check no machine here runs, in its quick CPU form on each Qwen-LM fixture model.

On the CPU nothing is captured, so this does not check CUDA graphs; it keeps the script
running (its imports, its model loading, its batch) until a GPU is lent, and checks that what
it compares off CUDA agrees: the sampler, the upstream-style and fast decode loops, the batch
with the option for graphs on and off.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from mizuoto.testing.fixtures import assets_root

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "gpu_check.py"


def _script():
    spec = importlib.util.spec_from_file_location("gpu_check_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.ASSETS = assets_root()
    return module


def test_the_gpu_check_runs_on_the_cpu(qwen_lm_dir, assembled, tmp_path, capsys):
    rc = _script().main(["--device", "cpu", "--quick", "--model", str(assembled[qwen_lm_dir]),
                         "--workdir", str(tmp_path)])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0, report
    assert report["device"] == "cpu"
    assert all(v["cases"] > 0 and v["mismatches"] == {"eager": 0, "graph": 0} for v in report["sampler"].values())
    decode = report["decode"]["float32"]
    assert decode["tokens_equal"] == {"upstream": True, "fast": True}
    assert decode["interleaved_tokens_equal"] == {"upstream": True, "fast": True}
    batch = report["batch"]
    assert batch["tokens_equal"] and len(batch["first_tokens"]) == batch["requests"]
    for mode in ("eager", "graphs"):
        assert not batch[mode]["captured"] and batch[mode]["batch"]["steps"] > 0

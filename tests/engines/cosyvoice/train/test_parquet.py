"""Training from upstream's parquet lists (the optional pyarrow extra) gives the recorded runs too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mizuoto.engines.cosyvoice.train.parquet import find_data_list
from mizuoto.engines.cosyvoice.train.session import StageSpec, run_training
from mizuoto.testing.train_cases import check_checkpoints, check_records, fewest_workers, run_meta

# `make test` installs the parquet extra: without pyarrow this module fails loudly, it is not skipped
import pyarrow  # noqa: E402,F401


@pytest.mark.parametrize("run,workers", fewest_workers(), ids=lambda x: f"{x.parent.name}-{x.name}" if isinstance(x, Path) else f"w{x}")
def test_parquet_list_matches_upstream(run, workers, assembled, tmp_path):
    data_list = find_data_list(run.parent / "data" / "parquet")
    assert data_list is not None, f"no parquet data.list under {run.parent / 'data'}"
    spec = StageSpec(run.name, assembled(run.parent), data_list, tmp_path, run / "train.yaml", workers=workers)
    log = run_training(spec)
    ref = json.loads((run / f"metrics_w{workers}.json").read_text(encoding="utf-8"))
    check_records("train", log.train, ref["train"])
    check_records("cv", log.cv, ref["cv"])
    check_checkpoints(tmp_path / run.name, run, workers, run_meta(run, workers))

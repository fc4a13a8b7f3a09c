"""Upstream's parquet lists (tools/make_parquet_list.py output) as training rows; needs the optional pyarrow.

A `data.list` names one parquet file per line (a relative name is relative to the list's
folder); each file is one shard, its rows in file order, read in batches of 64 as upstream's
parquet_opener reads them. The rows already carry audio bytes, speech tokens and embeddings.
"""

from __future__ import annotations

from pathlib import Path

from mizuoto.errors import InvalidRequest

DATA_LIST = "data.list"
COLUMNS = ("utt", "audio_data", "text", "spk", "utt_embedding", "spk_embedding", "speech_token")


def find_data_list(data: Path) -> Path | None:
    """The data.list `--data` names: the file itself, or data.list / parquet/data.list in a folder without wav.scp."""
    if data.is_file() and data.suffix == ".list":
        return data
    if data.is_dir() and not (data / "wav.scp").exists():
        for candidate in (data / DATA_LIST, data / "parquet" / DATA_LIST):
            if candidate.is_file():
                return candidate
    return None


def read_parquet_shards(data_list: Path) -> list[list[dict]]:
    """Every shard's rows as dicts (audio bytes under `wav`, as the pipeline reads them)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise InvalidRequest(f"{data_list}: reading parquet lists needs pyarrow (pip install 'mizuoto-runtime[parquet]')") from None
    names = [line.strip() for line in data_list.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not names:
        raise InvalidRequest(f"{data_list} lists no parquet file")
    shards = []
    for name in names:
        path = Path(name) if Path(name).is_absolute() else data_list.parent / name
        if not path.is_file():
            raise InvalidRequest(f"{data_list}: parquet file {path} not found")
        try:
            rows = []
            for batch in pq.ParquetFile(path).iter_batches(batch_size=64):
                for row in batch.to_pylist():
                    missing = [c for c in COLUMNS if c not in row]
                    if missing:
                        raise InvalidRequest(f"{path}: rows lack the column(s) {', '.join(missing)}")
                    row = dict(row)
                    row["wav"] = row.pop("audio_data")
                    rows.append(row)
        except (OSError, ValueError) as exc:
            raise InvalidRequest(f"cannot read parquet file {path}: {exc}") from None
        shards.append(rows)
    return shards

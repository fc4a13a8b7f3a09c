"""One `mizuoto bench --memory` case in this process: `python -m mizuoto.cli.memory_case SPEC_JSON`.

SPEC holds the model (`model_dir` or `random` with `workdir` and `assets`), the `driver` factory
if one was named, the load `options` and the `case` (runtime.bench_memory.MemoryCase's fields).
It prints one JSON line: the driver's name and the measured calls (or `{"error": ...}`), and on stderr a
line per measured call as it ends.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mizuoto.cli.bench import find_factory, load_factory
from mizuoto.errors import MizuotoError
from mizuoto.runtime.bench import BenchSettings
from mizuoto.runtime.bench_memory import case_process_main
from mizuoto.runtime.options import parse_options


def main(argv: list[str] | None = None) -> int:
    """Run the case SPEC names (argv[0], JSON) and print its calls."""
    spec = json.loads((argv if argv is not None else sys.argv[1:])[0])
    model_dir = Path(spec["model_dir"]) if spec.get("model_dir") else None
    factory = load_factory(spec["driver"]) if spec.get("driver") else find_factory(model_dir, spec.get("random"))
    options = parse_options(spec.get("options") or {}).resolved()
    extra = {"assets": spec["assets"]} if spec.get("assets") else {}

    def driver():
        return factory(model_dir, spec.get("random"), options, BenchSettings(), Path(spec["workdir"]), **extra)
    try:
        return case_process_main(driver, spec)
    except MizuotoError as exc:
        print(json.dumps({"error": str(exc)}))
        return 2


if __name__ == "__main__":
    sys.exit(main())

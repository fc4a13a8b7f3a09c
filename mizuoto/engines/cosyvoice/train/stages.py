"""`mizuoto train cosyvoice`: the stages of a method, run in order into one `--out` folder.

Layout of `--out`: `features/` (the three feature files), `llm/` and `flow/` (init.pt,
epoch_<E>_whole.pt + .yaml, metrics.json), `export/` (the fine-tuned model dir). Everything a
user can get wrong is checked before the first stage starts; a folder that already holds a
run is refused unless `resume`, which continues each training stage from its last epoch.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from mizuoto.engines.cosyvoice.train.export import AVERAGE_NUM, average_checkpoints, best_epochs, export_model_dir
from mizuoto.engines.cosyvoice.train.parquet import find_data_list
from mizuoto.engines.cosyvoice.train.features import FILES, extract_features, write_features
from mizuoto.engines.cosyvoice.train.recipe import check_audio, read_recipe
from mizuoto.engines.cosyvoice.train.session import StageSpec, log_json, open_model_dir, run_training, train_config
from mizuoto.engines.cosyvoice.variants import Variant
from mizuoto.errors import InvalidRequest
from mizuoto.files import atomic_write_bytes

METHODS = {"llm": ("features", "llm", "export"), "llm_flow": ("features", "llm", "flow", "export")}
STAGES = ("features", "llm", "flow", "export")
INSTRUCTED_LMS = ("CosyVoice3LM",)  # its training batches carry an instruction per utterance
_EPOCH_PT = re.compile(r"epoch_(\d+)_whole\.pt")


@dataclass(frozen=True)
class TrainRequest:
    """Everything `mizuoto train cosyvoice` was asked to do."""

    method: str
    model_dir: Path
    data_dir: Path
    out_dir: Path
    stages: tuple[str, ...] = ()
    config_path: Path | None = None
    workers: int = 0
    device: str = "cpu"
    memory: bool = False
    resume: bool = False
    average_num: int = AVERAGE_NUM


def _last_epoch(exp_dir: Path) -> Path | None:
    found = [(int(m.group(1)), p) for p in exp_dir.glob("epoch_*_whole.pt") if (m := _EPOCH_PT.fullmatch(p.name))]
    return max(found)[1] if found else None


def check_request(req: TrainRequest) -> tuple[tuple[str, ...], Variant, dict]:
    """The stages to run and the start dir's variant and yaml, after every check that needs no heavy work."""
    if req.method not in METHODS:
        raise InvalidRequest(f"--method {req.method!r} is not one of {', '.join(METHODS)}")
    stages = req.stages or METHODS[req.method]
    for stage in stages:
        if stage not in STAGES:
            raise InvalidRequest(f"--stage {stage!r} is not one of {', '.join(STAGES)}")
        if stage not in METHODS[req.method]:
            raise InvalidRequest(f"--stage {stage} is not part of --method {req.method}")
    if req.workers < 0:
        raise InvalidRequest(f"--workers must be 0 or more, got {req.workers}")
    variant, model_config = open_model_dir(req.model_dir)
    configs = {}
    for model in ("llm", "flow"):
        if model in stages:
            configs[model] = train_config(_spec(req, model), variant, model_config)
            if not (req.model_dir / f"{model}.pt").is_file():
                raise InvalidRequest(f"{req.model_dir} has no {model}.pt to start from")
    if find_data_list(req.data_dir) is None:
        utts = read_recipe(req.data_dir)
        check_audio(utts)
        lm_class = getattr(configs["llm"]["llm"], "cls", None) if "llm" in configs else None
        if lm_class in INSTRUCTED_LMS and any(u.instruct is None for u in utts):
            raise InvalidRequest(f"{req.data_dir} has no instruct list, which {lm_class} trains on "
                                 "(one line per utterance, e.g. 'utt You are a helpful assistant.<|endofprompt|>')")
    elif "features" in stages and req.stages:
        raise InvalidRequest(f"{req.data_dir} is a parquet list: its rows already carry the features")
    if not req.resume:
        for stage in stages:
            folder = req.out_dir / stage
            if folder.exists() and any(folder.iterdir()):
                raise InvalidRequest(f"{folder} already holds a run (pass --resume to continue it)")
    return stages, variant, model_config


def _spec(req: TrainRequest, model: str, checkpoint: Path | None = None) -> StageSpec:
    return StageSpec(model, req.model_dir, req.data_dir, req.out_dir, req.config_path, req.workers, req.device,
                     req.memory, checkpoint)


def run_request(req: TrainRequest, say: Callable[[str], None] = print,
                on_batch: Callable | None = None) -> Path | None:
    """Run the request's stages in order; the export's path when it ran."""
    stages, variant, model_config = check_request(req)
    exported = None
    for stage in stages:
        if stage == "features":
            if find_data_list(req.data_dir) is not None:
                say("features: taken from the parquet rows")
                continue
            if req.resume and all((req.out_dir / "features" / n).is_file() for n in FILES):
                say("features: already there")
                continue
            utts = read_recipe(req.data_dir)
            config = train_config(_spec(req, "llm"), variant, model_config)
            say(f"features: {len(utts)} utterances")
            write_features(req.out_dir / "features", extract_features(req.model_dir, variant, config, utts))
        elif stage in ("llm", "flow"):
            exp = req.out_dir / stage
            resume_from = _last_epoch(exp) if req.resume else None
            spec = _spec(req, stage, resume_from)
            if resume_from is not None:
                say(f"{stage}: resuming after {resume_from.name}")
            log = run_training(spec, on_batch=on_batch, save_init=resume_from is None)
            atomic_write_bytes(exp / "metrics.json", log_json(log).encode("utf-8"))
        elif stage == "export":
            weights = {}
            for model in ("llm", "flow"):
                if model in METHODS[req.method]:
                    best = best_epochs(req.out_dir / model, req.average_num)
                    say(f"export: {model}.pt = mean of {', '.join(p.stem for p in best)}")
                    weights[model] = average_checkpoints(best)
            exported = export_model_dir(req.model_dir, req.out_dir / "export", weights, replace=req.resume)
            say(f"export: {exported}")
    return exported


class Progress:
    """Per-epoch progress: one bar line per epoch on a terminal (batches, loss, lr), plain log lines otherwise."""

    def __init__(self, stream=None) -> None:
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.open_line = False  # a bar line without its newline yet

    def __call__(self, kind: str, record: dict) -> None:
        loss = float(record["loss"])
        if kind == "train":
            line = (f"epoch {record['epoch']} [{'#' * min(record['batch_idx'] + 1, 40):<40}] "
                    f"batch {record['batch_idx'] + 1} loss {loss:.6f} lr {record['lr']:.8f} "
                    f"grad_norm {float(record['grad_norm']):.6f}")
            if self.tty:
                self.stream.write("\r\x1b[2K" + line)
                self.open_line = True
                self.stream.flush()
                return
        else:
            line = f"epoch {record['epoch']} cv batch {record['batch_idx'] + 1} loss {loss:.6f}"
        if self.open_line:
            self.stream.write("\n")
            self.open_line = False
        self.stream.write(line + "\n")
        self.stream.flush()

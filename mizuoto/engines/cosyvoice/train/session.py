"""One training stage end to end: model dir + recipe folder + yaml -> checkpoints in `<out>/<model>/`.

Seeding follows the reference convention: the yaml's seed is given to `random`, numpy and
torch after the model is built and before the loaders exist; nothing is drawn while building.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch.utils.data import DataLoader

from mizuoto.engines.cosyvoice.frontend import CosyVoiceFrontend
from mizuoto.engines.cosyvoice.llm import QwenSpeechLM, TransformerSpeechLM, build_lm
from mizuoto.engines.cosyvoice.train.checkpoint import UpstreamState, read_checkpoint, tensors_of
from mizuoto.engines.cosyvoice.train.features import load_features
from mizuoto.engines.cosyvoice.train.flow_loss import CfmTraining, flow_loss
from mizuoto.engines.cosyvoice.train.lm_loss import qwen_lm_loss, transformer_lm_loss
from mizuoto.engines.cosyvoice.train.memory import checkpoint_blocks
from mizuoto.engines.cosyvoice.train.parquet import find_data_list, read_parquet_shards
from mizuoto.engines.cosyvoice.train.pipeline import TrainData, pipeline_stages, recipe_rows, shard_rows
from mizuoto.engines.cosyvoice.train.recipe import read_recipe
from mizuoto.engines.cosyvoice.train.tensorboard import ScalarLog
from mizuoto.engines.cosyvoice.train.trainer import Loaders, Trainer, TrainLog
from mizuoto.engines.cosyvoice.variants import Variant, find_variant, load_config
from mizuoto.errors import InvalidRequest, ModelLoadError
from mizuoto.runtime.hyperyaml import load_hyperyaml

MODELS = ("llm", "flow")
PREFETCH = 100  # upstream's --prefetch default
DIT_DROPOUT = 0.1  # upstream's DiT class default (its yamls leave it unset)


@dataclass(frozen=True)
class StageSpec:
    """What one `mizuoto train` stage works on."""

    model: str                    # "llm" | "flow"
    model_dir: Path
    data_dir: Path
    out_dir: Path
    config_path: Path | None = None
    workers: int = 0
    device: str = "cpu"
    memory: bool = False          # training.memory: gradient checkpointing
    checkpoint: Path | None = None  # start weights (default <model_dir>/<model>.pt)


def yaml_seed(config: dict) -> int | None:
    """The seed the yaml gives `random.seed` (upstream's `__set_seed1`), if any."""
    for key, node in config.items():
        if key.startswith("__") and getattr(node, "target", None) == "random.seed" and node.args:
            return int(node.args[0])
    return None


def seed_all(seed: int) -> None:
    """upstream's set_all_random_seed."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def open_model_dir(model_dir: Path) -> tuple[Variant, dict]:
    """The start dir's variant and parsed yaml."""
    variant = find_variant(model_dir)
    if variant is None:
        raise ModelLoadError(f"{model_dir} holds no CosyVoice yaml (cosyvoice.yaml / cosyvoice2.yaml / cosyvoice3.yaml)")
    return variant, load_config(model_dir, variant)


def train_config(spec: StageSpec, variant: Variant, model_config: dict) -> dict:
    """The yaml the stage trains with: --config, else the start dir's own."""
    config = model_config if spec.config_path is None else _given_config(spec, variant)
    conf = config.get("train_conf")
    if not isinstance(conf, dict):
        raise InvalidRequest("the training yaml has no train_conf")
    if int(conf.get("save_per_step", -1)) > 0:
        raise InvalidRequest("train_conf.save_per_step > 0 (mid-epoch checkpoints) is not supported; set it to -1")
    if int(conf.get("accum_grad", 1)) < 1:
        raise InvalidRequest(f"train_conf.accum_grad must be 1 or more, got {conf.get('accum_grad')}")
    return config


def _given_config(spec: StageSpec, variant: Variant) -> dict:
    if not spec.config_path.is_file():
        raise InvalidRequest(f"--config {spec.config_path} does not exist")
    config = load_hyperyaml(spec.config_path)
    node = config.get(spec.model)
    allowed = variant.llm_classes if spec.model == "llm" else variant.flow_classes
    if getattr(node, "cls", None) not in allowed:
        raise InvalidRequest(f"--config {spec.config_path}: `{spec.model}` is {getattr(node, 'cls', None)}, "
                             f"but the start dir is CosyVoice {variant.version} ({' or '.join(allowed)})")
    return config


def _tied_keys(sd: dict) -> dict[str, str]:
    first: dict[int, str] = {}
    tied = {}
    for key, t in tensors_of(sd).items():
        ptr = t.untyped_storage().data_ptr()
        if ptr in first and t.data_ptr() == sd[first[ptr]].data_ptr():
            tied[key] = first[ptr]
        else:
            first.setdefault(ptr, key)
    return tied


def build_training_flow(config: dict) -> torch.nn.Module:
    """The yaml's flow with untrained weights and the dropout rates training uses."""
    from mizuoto.engines.cosyvoice.flow import build_flow

    flow = build_flow(config)
    estimator = config["flow"]["decoder"]["estimator"]
    if getattr(estimator, "cls", None) == "DiT":
        # the inference build leaves the DiT's dropout at 0; training uses the yaml's rate
        rate = float(estimator.get("dropout", DIT_DROPOUT))
        for module in flow.decoder.estimator.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = rate
    return flow


def build_model(spec: StageSpec, config: dict) -> tuple[torch.nn.Module, UpstreamState, dict]:
    """The model the stage trains, with its start weights loaded, and its start checkpoint."""
    if spec.model not in MODELS:
        raise InvalidRequest(f"cannot train {spec.model!r} (one of {', '.join(MODELS)})")
    lm = build_lm(config["llm"], spec.model_dir) if spec.model == "llm" else build_training_flow(config)
    path = spec.checkpoint or spec.model_dir / f"{spec.model}.pt"
    sd = read_checkpoint(path)
    tensors = tensors_of(sd)
    state = UpstreamState(lm, list(tensors), _tied_keys(sd))
    unknown = sorted(set(tensors) - set(state.ours) - set(state.tied))
    if unknown:
        raise ModelLoadError(f"{path} does not fit {getattr(lm, 'variant', 'the model')}: unexpected key {unknown[0]!r}")
    lm.load_state_dict({name: tensors[up] for up, name in state.ours.items()}, strict=True)
    return lm, state, sd


def model_forward(model: torch.nn.Module, config: dict, memory: bool) -> Callable:
    """The training forward of the model: batch, device -> {'loss'[, 'acc']}."""
    if not isinstance(model, (QwenSpeechLM, TransformerSpeechLM)):
        cfm = CfmTraining.from_flow_node(config["flow"])
        return lambda batch, device: flow_loss(model, batch, device, cfm)
    node = config["llm"]
    smoothing = float(node.get("lsm_weight", 0.0))
    normalize = bool(node.get("length_normalized_loss", True))
    if isinstance(model, QwenSpeechLM):
        return lambda batch, device: qwen_lm_loss(model, batch, device, smoothing, normalize, memory)
    return lambda batch, device: transformer_lm_loss(model, batch, device, smoothing, normalize)


def make_loaders(spec: StageSpec, variant: Variant, config: dict) -> Loaders:
    """Train and validation loaders over the recipe or parquet list (validation on the train list, as upstream's recipe)."""
    data_list = find_data_list(spec.data_dir)
    if data_list is not None:
        shards = read_parquet_shards(data_list)
    else:
        utts = read_recipe(spec.data_dir)
        features = load_features(spec.out_dir / "features") or load_features(spec.data_dir)
        if features is None:
            raise InvalidRequest(f"no features for {spec.data_dir}: run `--stage features` first")
        shards = shard_rows(recipe_rows(utts, features))
    frontend = CosyVoiceFrontend(spec.model_dir, variant, config)
    stages = pipeline_stages(config, frontend.tokenizer.encode)
    train_set = TrainData(shards, stages, shuffle_shards=True, partition=True)
    cv_set = TrainData(shards, stages, shuffle_shards=False, partition=False)
    prefetch = PREFETCH if spec.workers > 0 else None

    def loader(ds: TrainData) -> DataLoader:
        return DataLoader(ds, batch_size=None, num_workers=spec.workers, prefetch_factor=prefetch)
    return Loaders(train_set, loader(train_set), loader(cv_set))


def run_training(spec: StageSpec, on_batch: Callable | None = None, save_init: bool = True) -> TrainLog:
    """Train one model as upstream's bin/train.py: init.pt, then epoch_<E>_whole.pt per epoch, in <out>/<model>/."""
    variant, model_config = open_model_dir(spec.model_dir)
    config = train_config(spec, variant, model_config)
    device = torch.device(spec.device)
    model, state, start = build_model(spec, config)
    forward = model_forward(model, config, spec.memory)
    if spec.memory:
        checkpoint_blocks(model)
    seed = yaml_seed(config)
    if seed is not None:
        seed_all(seed)
    loaders = make_loaders(spec, variant, config)
    model.to(device)
    conf = dict(config.get("train_conf") or {})
    trainer = Trainer(model, forward, state, conf, spec.out_dir / spec.model, device,
                      start_epoch=int(start.get("epoch", -1)), start_step=int(start.get("step", 0)),
                      on_batch=on_batch, scalars=ScalarLog(spec.out_dir / spec.model / "tensorboard"))
    if save_init:
        trainer.save_init()
    return trainer.run(loaders)


def f32_hex(x) -> str:
    """Big-endian hex of a value as float32 (the fixtures' `f32`)."""
    return np.array(float(x) if not isinstance(x, torch.Tensor) else x.item(), dtype=">f4").tobytes().hex()


def log_json(log: TrainLog) -> str:
    """The log as the fixtures' metrics json (values and their float32 hex)."""
    def value(v):
        if isinstance(v, torch.Tensor):
            return {"value": v.item(), "f32": f32_hex(v), "dtype": str(v.dtype)}
        if isinstance(v, float):
            return {"value": v, "f32": None, "dtype": "float"}
        return v
    def rec(r):
        return {k: value(v) for k, v in r.items()}
    return json.dumps({"train": [rec(r) for r in log.train], "cv": [rec(r) for r in log.cv],
                       "cv_summary": log.cv_summary, "saves": log.saves}, indent=1)

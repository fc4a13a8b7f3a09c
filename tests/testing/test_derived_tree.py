"""The second fixture tree: the same recordings under other names and key styles, one clip fewer."""

import json

import pytest
import torch

from mizuoto.testing.cosyvoice_cases import list_cases, load_case
from mizuoto.testing.cosyvoice_full import list_full_cases, load_full_case
from mizuoto.testing.cpu_recordings import recording_for, this_class
from mizuoto.testing.derived_tree import case_name, derive, legacy_hift
from mizuoto.testing.fixtures import fixtures_root


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    src = fixtures_root()
    return src, derive(src, tmp_path_factory.mktemp("derived") / "fixtures")


def test_cases_are_renamed_and_hold_the_same_tensors_without_aliases(trees):
    src, dest = trees
    for listing, load in ((list_cases, load_case), (list_full_cases, load_full_case)):
        before = {(p.json_path if hasattr(p, "json_path") else p) for p in listing(src)}
        after = {(p.json_path if hasattr(p, "json_path") else p) for p in listing(dest)}
        assert len(before) == len(after) > 0
        for old in before:
            new = dest / old.relative_to(src).with_name(f"{case_name(old.stem)}.json")
            assert new in after and new.stem != old.stem
            meta = json.loads(new.read_text(encoding="utf-8"))
            assert "aliases" not in meta
            ours, theirs = load(new), load(old)
            assert set(ours.tensors) == set(theirs.tensors)
            assert all(torch.equal(ours[k], theirs[k]) for k in theirs.tensors)
    order = lambda root: [p.stem for p in sorted(root.glob("cosyvoice/*/cases/*.json"))]  # noqa: E731
    assert [case_name(n) for n in order(src) if n != "construction_noise"] != \
        [n for n in order(dest) if n != "construction_noise"], "the derived names keep the sorted order"


def test_per_cpu_recordings_follow_their_cases(trees):
    src, dest = trees
    for path in sorted((src / "full" / "cpu").glob("*/*/cases/*.json")):
        moved = dest / path.relative_to(src).with_name(f"{case_name(path.stem)}.json")
        assert json.loads(moved.read_text())["case"] == case_name(path.stem)
        assert moved.with_suffix(".safetensors").is_file()
        case = dest / "full" / path.parent.parent.name / "cases" / moved.name
        assert case.is_file(), f"{moved} names no case of the derived tree"
    assert recording_for(dest / "full", this_class()).exact == recording_for(src / "full", this_class()).exact


def test_hift_takes_the_legacy_key_style(trees):
    src, dest = trees
    for old in sorted(src.glob("cosyvoice/*/model/hift.pt")):
        state = torch.load(old, map_location="cpu", weights_only=True)
        legacy = torch.load(dest / old.relative_to(src), map_location="cpu", weights_only=True)
        assert legacy.keys() == legacy_hift(state).keys() and len(legacy) == len(state)
        assert all(k.startswith("generator.") for k in legacy)
        assert any(k.endswith(".weight_g") for k in legacy) == any(
            ".parametrizations.weight.original0" in k or k.endswith(".weight_g") for k in state)
        assert legacy_hift(legacy).keys() == legacy.keys()  # a legacy file stays as it is


def test_the_shortest_clip_is_left_out(trees):
    src, dest = trees
    clips = json.loads((src / "frontend" / "manifest.json").read_text())["clips"]
    kept = json.loads((dest / "frontend" / "manifest.json").read_text())["clips"]
    shortest = min(clips, key=lambda c: clips[c]["num_samples"] / clips[c]["sample_rate"])
    assert set(kept) == set(clips) - {shortest}
    assert not (dest / "frontend" / clips[shortest]["wav"]).exists()
    assert all((dest / "frontend" / c["wav"]).is_file() for c in kept.values())


def test_an_existing_destination_is_refused(trees):
    src, dest = trees
    with pytest.raises(FileExistsError):
        derive(src, dest)

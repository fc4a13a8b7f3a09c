"""Case discovery: every manifest found, non-cases skipped, tensors and aliases as the manifest lists."""

import json

from mizuoto.testing.cosyvoice_cases import list_cases, load_case
from mizuoto.testing.fixtures import fixtures_root


def test_every_case_manifest_is_listed_and_loads():
    jsons = sorted(fixtures_root().glob("cosyvoice/*/cases/*.json"))
    cases = [p for p in jsons if "model_dir_relative_to_this_file" in json.loads(p.read_text())]
    refs = list_cases()
    assert cases and [r.json_path for r in refs] == cases
    assert len({r.id for r in refs}) == len(refs)
    for ref in refs:
        case = load_case(ref)
        assert ref.model_dir.is_dir() and ref.yaml_path.is_file()
        for name, spec in case.meta["tensors"].items():
            assert list(case[name].shape) == spec["shape"], f"{ref.id}: {name}"
            assert ref.has(name)
        for name, stored in case.meta.get("aliases", {}).items():
            assert case[name] is case[stored]
        assert load_case(ref.json_path).ref == ref

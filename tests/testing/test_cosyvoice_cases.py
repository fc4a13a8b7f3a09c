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


def test_first_speaking_seed_skips_silent_and_rejected_seeds():
    import pytest

    from mizuoto.errors import InvalidRequest, MizuotoError
    from mizuoto.testing.cosyvoice_cases import first_speaking_seed

    def attempt(seed):
        if seed < 12:
            raise MizuotoError(f"the LM produced special token {seed} instead of eos")
        return [] if seed < 14 else [seed]
    assert first_speaking_seed(attempt, 10) == (14, [14])
    seed, outcome = first_speaking_seed(attempt, 10, tries=3)  # none speaks: the first seed's outcome
    assert seed == 10 and isinstance(outcome, MizuotoError) and "special token 10" in str(outcome)
    assert first_speaking_seed(lambda s: [], 5, tries=2) == (5, [])
    with pytest.raises(InvalidRequest):  # any other error is the test's failure, not an outcome
        first_speaking_seed(lambda s: (_ for _ in ()).throw(InvalidRequest("bad input")), 0)


def test_bistream_text_outlasts_the_reference():
    import torch

    from mizuoto.testing.cosyvoice_cases import bistream_text

    text, prompt_text = torch.arange(7).reshape(1, 7), torch.zeros(1, 4, dtype=torch.long)
    for prompt_tokens in (0, 15, 61, 400):
        out = bistream_text(text, prompt_text, prompt_tokens, piece=2, mix_ratio=(5, 15))
        before_speech = 5 * -(-prompt_tokens // 15) + 5 - 4
        assert out.shape[1] >= max(3 * 7, before_speech + 3 * 2) and out.shape[1] % 7 == 0
        assert torch.equal(out[:, :7], text)

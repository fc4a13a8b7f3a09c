"""The one checkpoint matcher: key maps, transposes and folds named, every source used once, one error format."""

import pytest
import torch

from mizuoto.errors import ModelLoadError
from mizuoto.runtime.convert.checkpoint import DictSource, Fold, Src, load_checkpoint, match_state_dict, read_checkpoint


def _shapes():
    return {"a.weight": (3, 2), "b.weight": (2, 3), "c.weight": (4,)}


def _source():
    return DictSource({"up.a": torch.ones(3, 2), "up.b_t": torch.arange(6.0).reshape(3, 2),
                       "g": torch.full((4,), 2.0), "v": torch.ones(4)})


def _map():
    return {"a.weight": "up.a", "b.weight": Src("up.b_t", transpose=True),
            "c.weight": Fold(("g", "v"), lambda g, v: g * v, "product")}


def test_every_key_is_filled_through_its_declared_source():
    out = match_state_dict(_source(), _map(), _shapes(), where="x.pt", target="the toy")
    assert torch.equal(out["b.weight"], torch.arange(6.0).reshape(3, 2).t())
    assert torch.equal(out["c.weight"], torch.full((4,), 2.0))
    assert list(out) == ["a.weight", "b.weight", "c.weight"]


@pytest.mark.parametrize("change, words", [
    (lambda s, m: s.pop("up.a"), "missing keys: up.a"),
    (lambda s, m: s.update({"extra": torch.zeros(1)}), "unexpected keys: extra"),
    (lambda s, m: s.update({"up.a": torch.ones(2, 2)}), r"up.a has shape \(2, 2\), expected \(3, 2\) for a.weight"),
    (lambda s, m: m.update({"b.weight": "up.b_t"}), r"up.b_t has shape \(3, 2\), expected \(2, 3\) for b.weight"),
    (lambda s, m: m.update({"a.weight": "up.b_t"}), "up.b_t mapped twice"),
    (lambda s, m: m.pop("a.weight"), "no source for a.weight"),
    (lambda s, m: s.pop("v"), "missing keys: v; unexpected keys: g"),
])
def test_each_mismatch_is_one_line_naming_it(change, words):
    source, key_map = _source(), _map()
    change(source, key_map)
    with pytest.raises(ModelLoadError, match=words) as err:
        match_state_dict(source, key_map, _shapes(), where="x.pt", target="the toy")
    assert str(err.value).startswith("x.pt does not match the toy: ") and "\n" not in str(err.value)


def test_ignored_sources_are_consumed():
    source = _source()
    source["config.rate"] = torch.tensor(16000)
    match_state_dict(source, _map(), _shapes(), where="x.pt", target="the toy", ignore=["config.rate"])


def test_read_and_load_a_pt_file(tmp_path):
    lin = torch.nn.Linear(2, 3)
    torch.save(lin.state_dict(), tmp_path / "lin.pt")
    other = torch.nn.Linear(2, 3)
    load_checkpoint(other, tmp_path / "lin.pt", target="a linear layer")
    assert torch.equal(other.weight, lin.weight)
    with pytest.raises(ModelLoadError, match="checkpoint missing: .*absent.pt not found"):
        read_checkpoint(tmp_path / "absent.pt")
    (tmp_path / "bad.pt").write_bytes((tmp_path / "lin.pt").read_bytes()[:50])
    with pytest.raises(ModelLoadError, match="cannot read .*bad.pt"):
        read_checkpoint(tmp_path / "bad.pt")
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(ModelLoadError, match="not a state dict of tensors"):
        read_checkpoint(tmp_path / "list.pt")

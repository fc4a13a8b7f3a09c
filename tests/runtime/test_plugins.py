"""Plugin registry: built-ins and entry points through one hook, lazily; broken plugins reported, not fatal."""

import subprocess
import sys
import types

import pytest

from mizuoto.runtime import plugins
from mizuoto.errors import InvalidRequest, ModelLoadError, ResourceError
from mizuoto.runtime.hookspecs import EngineRef, hookimpl
from mizuoto.runtime.plugins import Registry
from mizuoto.testing.toy import ToneEngine


def _failures(reg):
    return {f.plugin: f.error for f in reg.failures}


def test_entry_points_discovered_and_broken_ones_reported():
    reg = Registry()
    assert "tone" in reg.names() and reg.plugin_of("tone") == "toy"
    assert "cosyvoice" in reg.names() and reg.plugin_of("cosyvoice") == "builtin"
    fails = _failures(reg)
    assert fails["broken-import"] == "import failed: ImportError: deliberately broken plugin: a dependency is missing"
    assert fails["broken-hook"] == "mizuoto_engines failed: RuntimeError: deliberately broken hook"
    assert reg.engine_class("tone") is ToneEngine
    assert "tone" in reg.load_all()


def test_nothing_heavy_imported_until_used():
    code = ("import sys; from mizuoto.runtime.plugins import Registry; r = Registry(); "
            "assert 'mizuoto.testing.toy' not in sys.modules; "
            "assert not any(m.startswith('mizuoto.engines.') for m in sys.modules), sorted(sys.modules); "
            "r.engine_class('tone'); assert 'mizuoto.testing.toy' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_lazy_builtin_that_fails_is_reported_by_name(monkeypatch):
    monkeypatch.setattr(plugins, "BUILTIN_ENGINES", {"ghost": ("mizuoto.no_such_module", "GhostEngine", ()),
                                                     "fake": ("mizuoto.testing.toy", "ToneModel", ())})
    reg = Registry(entry_points=False)
    assert reg.names() == ["fake", "ghost"]
    with pytest.raises(ModelLoadError, match="engine 'ghost' \\(plugin builtin\\) failed to load: "
                                             "ModuleNotFoundError: No module named 'mizuoto.no_such_module'"):
        reg.engine_class("ghost")
    with pytest.raises(ModelLoadError, match="not an Engine subclass"):
        reg.engine_class("fake")
    assert reg.load_all() == {}
    assert [f.plugin for f in reg.failures] == ["builtin", "builtin"]
    with pytest.raises(InvalidRequest, match="unknown engine 'nope'; registered engines: fake, ghost"):
        reg.engine_class("nope")


class _Misnamed(ToneEngine):
    name = "Not A Name"


class _Plugin:
    def __init__(self, result):
        self.result = result

    @hookimpl
    def mizuoto_engines(self):
        return self.result


class _Assets:
    @hookimpl
    def mizuoto_assets(self):
        return {"tone/extras": ["/opt/tone-extras"]}


class _BadAssets:
    @hookimpl
    def mizuoto_assets(self):
        raise OSError("disk gone")


class _Examples:
    @hookimpl
    def mizuoto_example_models(self):
        return ["/opt/tone-model"]


def test_malformed_plugins_each_reported():
    extra = (_Plugin("tone"), _Plugin([42]), _Plugin([_Misnamed]), _Plugin([ToneEngine]), _Plugin([ToneEngine]),
             _Plugin([EngineRef("tone", "mizuoto.testing.toy", "ToneEngine")]),
             types.ModuleType("hookless"), _Assets(), _BadAssets(), _Examples())
    for i, obj in enumerate(extra):
        obj.__name__ = f"p{i}"
    reg = Registry(entry_points=False, builtins=False, extra=extra)
    fails = _failures(reg)
    assert fails["p0"] == "mizuoto_engines failed: TypeError: mizuoto_engines returned str, not a list"
    assert fails["p1"] == "42 is neither an Engine subclass nor an EngineRef"
    assert fails["p2"] == "engine name 'Not A Name' is not a lowercase identifier"
    assert "p4" not in fails  # the same class twice is harmless
    assert fails["p5"] == "engine 'tone' is already provided by 'p3'"
    assert fails["p6"] == "provides no mizuoto hooks"
    assert reg.names() == ["tone"] and reg.engine_class("tone") is ToneEngine
    assert [str(p) for p in reg.asset_candidates("tone/extras")] == ["/opt/tone-extras"]
    assert _failures(reg)["p8"] == "mizuoto_assets failed: OSError: disk gone"
    assert "p9" not in _failures(reg) and [str(p) for p in reg.example_models()] == ["/opt/tone-model"]


def test_engine_ref_name_must_match():
    reg = Registry(entry_points=False, builtins=False,
                   extra=(_Plugin([EngineRef("beep", "mizuoto.testing.toy", "ToneEngine")]),))
    with pytest.raises(ModelLoadError, match="name is 'tone', registered as 'beep'"):
        reg.engine_class("beep")


def test_find_resource_asks_plugins(monkeypatch, tmp_path):
    found = tmp_path / "lexicon"
    found.mkdir()
    reg = Registry(entry_points=False, builtins=False, extra=(_Plugin([]),))

    class _Lexicon:
        @hookimpl
        def mizuoto_assets(self):
            return {"tone/lexicon": [tmp_path / "absent", found]}

    reg._register(_Lexicon(), "lexicon")
    monkeypatch.setenv("MIZUOTO_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(plugins, "default_registry", lambda: reg)
    assert plugins.find_resource("tone/lexicon") == found
    with pytest.raises(ResourceError, match="shared resource 'tone/other' not found"):
        plugins.find_resource("tone/other")


def test_engine_ref_patterns_keep_unmatched_engines_unimported(tmp_path):
    """A directory without a matching file is answered "no" without importing the engine."""
    (tmp_path / "other.txt").write_text("x")
    code = ("import sys; from mizuoto.runtime.plugins import Registry; r = Registry(); "
            f"hits, checked = r.detect_report({str(tmp_path)!r}); "
            "assert 'mizuoto.engines.cosyvoice.engine' not in sys.modules, checked; "
            "assert 'mizuoto_piper.engine' not in sys.modules, checked; "
            "assert any(c.startswith('cosyvoice: no (no cosyvoice*.yaml)') for c in checked), checked")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_engine_ref_patterns_let_matching_dirs_through(tmp_path):
    reg = Registry(entry_points=False, builtins=False,
                   extra=(_Plugin([EngineRef("tone", "mizuoto.testing.toy", "ToneEngine", patterns=("*.tone",))]),))
    assert not EngineRef("x", "m", "a", ("*.tone",)).may_detect(tmp_path)
    assert reg.detect(tmp_path) == []
    assert "tone" not in reg._classes  # not imported for a directory without *.tone
    from mizuoto.testing.toy import write_model
    model = write_model(tmp_path / "m")
    (model / "voice.tone").write_text("")
    assert EngineRef("x", "m", "a", ("*.tone",)).may_detect(model)
    assert [name for name, _ in reg.detect(model)] == ["tone"]


def test_every_hook_has_an_implementer_among_the_installed_plugins():
    """pytest's rule for hookspec.py: no hook is declared that nobody implements."""
    from mizuoto.runtime import hookspecs

    reg = Registry()
    declared = sorted(n for n in dir(hookspecs) if n.startswith("mizuoto_"))
    assert declared == ["mizuoto_assets", "mizuoto_engines", "mizuoto_example_models"]
    implementers = {n: {reg.pm.get_name(i.plugin) for i in getattr(reg.pm.hook, n).get_hookimpls()}
                    for n in declared}
    assert "builtin" in implementers["mizuoto_engines"] and "piper" in implementers["mizuoto_engines"]
    assert "piper" in implementers["mizuoto_example_models"]
    assert implementers["mizuoto_assets"] - {"toy"}, "no real plugin implements mizuoto_assets"


def test_piper_offers_its_default_voice_as_an_example_model():
    import mizuoto_piper

    examples = Registry().example_models()
    assert mizuoto_piper.default_voice_dir() in examples
    assert all(Registry().detect(p) for p in examples)

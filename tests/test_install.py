"""Installing: our distribution is `mizuoto-runtime` (PyPI's `mizuoto` is an unrelated project), every
install command the docs or the package's messages print installs ours or a known dependency, the
hub's command names are the installed hub client's, and `make demo` installs no test tools.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OURS = "mizuoto-runtime"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PLUGINS = sorted(p for p in (REPO / "plugins").glob("*") if (p / "pyproject.toml").is_file())


def _name(requirement: str) -> str:
    """The normalized distribution name of a requirement string (`Foo_Bar[x]>=1; marker` -> foo-bar)."""
    return re.split(r"[\s\[<>=!~;@]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _known() -> set[str]:
    """Ours, our plugins, and every dependency we or they declare (extras included), plus the docs' helpers."""
    names = {OURS, "modelscope"}  # modelscope: the README's other way to download a model
    projects = [PYPROJECT] + [tomllib.loads((p / "pyproject.toml").read_text()) for p in PLUGINS]
    for project in projects:
        names.add(_name(project["project"]["name"]))
        deps = list(project["project"].get("dependencies", []))
        for extra in project["project"].get("optional-dependencies", {}).values():
            deps += extra
        names |= {_name(d) for d in deps}
    return names


def _docs() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "plugins").rglob("*.md"))]


def _sources() -> list[Path]:
    return [*sorted((REPO / "mizuoto").rglob("*.py")), *sorted(p for p in (REPO / "plugins").rglob("*.py")
                                                              if "tests" not in p.parts)]


# `pip install ARGS` up to the end of the line, a backtick, a comment, a parenthesis or the next shell command
_PIP = re.compile(r"pip install\s+((?:(?!&&|;|\|| \()[^`\n#)])*)")


def install_commands(text: str) -> list[str]:
    """Every `pip install ...` argument string in `text`."""
    return [m.group(1).strip() for m in _PIP.finditer(text)]


def foreign_installs(args: str, known: set[str], extras: set[str]) -> list[str]:
    """What `pip install ARGS` would install that is neither ours (a path of this checkout, mizuoto-runtime)
    nor a known dependency; an extra of ours that pyproject does not declare counts too."""
    try:
        words = shlex.split(args)
    except ValueError:  # an unbalanced quote: the message's own quoting; take the words as they are
        words = args.split()
    bad = []
    for word in words:
        word = word.strip("'\"")
        if not word or word.startswith("-") or word.startswith("$"):
            continue
        local = word.startswith((".", "/", "plugins/", "dist/", "tests/")) or word.endswith(".whl")
        named = re.match(r"^([^\[]*)(?:\[([^\]]*)\])?", word)
        base, wanted = named.group(1), named.group(2)
        if wanted and (local and not base.startswith("plugins/") or _name(base) == OURS):
            bad += [f"{word} (no extra {x!r})" for x in wanted.split(",") if x.strip() and x.strip() not in extras]
        if local:
            continue
        if _name(base) not in known:
            bad.append(word)
    return bad


EXTRAS = set(PYPROJECT["project"]["optional-dependencies"])
KNOWN = _known()


def test_our_distribution_has_a_name_of_its_own():
    assert PYPROJECT["project"]["name"] == OURS
    assert PYPROJECT["project"]["scripts"]["mizuoto"] == "mizuoto.cli.main:main"
    for plugin in PLUGINS:  # the plugins depend on this checkout's core by its name
        deps = [_name(d) for d in tomllib.loads((plugin / "pyproject.toml").read_text())["project"]["dependencies"]]
        assert OURS in deps and "mizuoto" not in deps, plugin.name
    assert metadata.distribution(OURS).read_text("entry_points.txt") is not None  # installed under that name


def test_the_checker_catches_someone_elses_package():
    for planted in ("pip install 'mizuoto[server]'", "pip install mizuoto", 'pip install -U "mizuoto[hub]"',
                    "pip install somebody-elses-tts"):
        assert any(foreign_installs(a, KNOWN, EXTRAS) for a in install_commands(planted)), planted
    for fine in ("pip install -e '.[server]'", "pip install '/path/to/checkout[server]'", "pip install -e .",
                 "pip install 'mizuoto-runtime[aac]' (PyAV)", "pip install -e plugins/mizuoto-piper",
                 "pip install dist/mizuoto_runtime-0.2.0-py3-none-any.whl", "pip install onnxruntime"):
        found = install_commands(fine)
        assert found and not any(foreign_installs(a, KNOWN, EXTRAS) for a in found), fine
    assert foreign_installs("-e '.[nonesuch]'", KNOWN, EXTRAS)  # an extra we do not declare


@pytest.mark.parametrize("path", _docs() + _sources(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_install_command_installs_ours_or_a_known_dependency(path):
    text = path.read_text(encoding="utf-8")
    bad = [(args, foreign_installs(args, KNOWN, EXTRAS)) for args in install_commands(text)]
    bad = [b for b in bad if b[1]]
    assert not bad, f"{path.relative_to(REPO)}: {bad}"


def test_no_doc_installs_the_other_mizuoto():
    pattern = re.compile(r"pip install\s+(-U\s+)?['\"]?mizuoto(\[|['\"\s]|$)", re.M)
    hits = [str(p.relative_to(REPO)) for p in _docs() + _sources() if pattern.search(p.read_text(encoding="utf-8"))]
    assert not hits


# --- the hub client's command names ------------------------------------------------------------------------

def _hub_scripts() -> set[str]:
    dist = metadata.distribution("huggingface_hub")
    return {ep.name for ep in dist.entry_points if ep.group == "console_scripts"}


def test_hub_commands_in_docs_and_messages_are_the_installed_clients():
    """Each `hf ...`/`huggingface-cli ...` command named is a console script of the installed huggingface_hub
    (the hub extra); the old `huggingface-cli` is named nowhere."""
    from mizuoto.runtime import hub

    scripts = _hub_scripts()
    assert "hf" in scripts
    assert hub.DOWNLOAD.split()[0] in scripts
    named = set()
    for path in _docs() + _sources():
        text = path.read_text(encoding="utf-8")
        named |= set(re.findall(r"\b(hf|huggingface-cli)\s+download\b", text))
        # an extra of huggingface_hub the docs install must exist
        for extra in re.findall(r"huggingface_hub\[(\w+)\]", text):
            assert extra in (metadata.metadata("huggingface_hub").get_all("Provides-Extra") or []), (path, extra)
    assert named == {"hf"}, named


def test_hf_download_takes_what_the_readme_gives_it():
    readme = (REPO / "README.md").read_text()
    line = next(x for x in readme.splitlines() if x.startswith("hf download "))
    assert "--local-dir" in line
    exe = Path(sys.executable).with_name("hf")
    done = subprocess.run([str(exe), "download", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--local-dir" in done.stdout


def test_the_offline_message_names_the_hub_client(monkeypatch, tmp_path):
    pytest.importorskip("huggingface_hub")
    from huggingface_hub import constants

    from mizuoto.errors import ModelLoadError
    from mizuoto.runtime.hub import resolve_model

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelLoadError, match=r"\(hf download nobody-here/no-model\)"):
        resolve_model("nobody-here/no-model")


# --- what make demo installs ------------------------------------------------------------------------------

def _recipe(target: str) -> str:
    done = subprocess.run(["make", "-n", "-B", "-C", str(REPO), target], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_make_demo_installs_the_runtime_and_its_engine_without_test_tools():
    demo = _recipe(".venv/.installed")
    installs = re.findall(r"pip install [^\n]*", demo)
    extras = {x for line in installs for group in re.findall(r"\.\[([^\]]*)\]", line) for x in group.split(",")}
    assert extras == {"cosyvoice"}, extras  # no test, server or other extras
    assert "plugins/mizuoto-piper" in demo and "tests/plugins" not in demo
    assert "fetch whisper-vocab" in demo
    assert all(" -q" not in line for line in installs)  # pip says what it installs
    assert demo.count('echo "== make:') >= 4  # and make says what it is doing
    test = _recipe(".venv/.installed-test")
    assert "test," in test and "plot" in test and "tests/plugins" in test
    # the cosyvoice extra brings data only: no openai-whisper (triton, numba, llvmlite)
    assert not any(_name(d) == "openai-whisper" for d in PYPROJECT["project"]["optional-dependencies"]["cosyvoice"])

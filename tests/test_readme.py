"""The README's shell blocks run as written, in order, in one folder, as a reader of a fresh clone would run them.

A marker right before a block, `<!-- readme-test: KIND: why -->`, says how it is run:
- no marker, or `run`: as written (the `why` says what the test changes around it, e.g. the port);
- `make`: as written, where each `make` command runs what `make -n` prints for it, with this
  test's python standing in for the .venv make would create (`make demo` would build a venv, and
  `make test` is this very suite: it is only checked to call pytest);
- `network`: not run (it downloads); what the test puts in its place is in the `why`.
Model directories the blocks name (`models/NAME`) are complete fixture models of the variant NAME
names (random weights), laid where the network block would have downloaded them.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import soundfile

from mizuoto.runtime.api import Runtime
from mizuoto.server.launch import free_port
from mizuoto.testing.cosyvoice_cases import assemble_model_dir
from mizuoto.testing.fixtures import fixtures_root

_REPO = Path(__file__).resolve().parents[1]
README = _REPO / "README.md"
SHELLS = ("sh", "bash", "shell")
KINDS = ("run", "make", "network")
_FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```\s*$", re.M | re.S)
_MARKER = re.compile(r"<!--\s*readme-test:\s*([\w-]+)\s*:(.*?)-->\s*\Z", re.S)
_MODEL = re.compile(r"(?<![\w/.-])models/([\w.-]+)")
_OUTPUT = re.compile(r"(?:\s-o\s+|write_to_file\(\")([\w./-]+\.wav)")


@dataclass(frozen=True)
class Block:
    """A fenced block of the README: its language, text, marker kind (None: no marker) and first line."""

    lang: str
    text: str
    marker: str | None
    line: int

    @property
    def kind(self) -> str:
        return self.marker or "run"

    @property
    def makes(self) -> bool:
        return any(re.match(r"\s*make\b", line) for line in self.text.splitlines())


def blocks(text: str) -> list[Block]:
    """Every fenced block, with the marker between it and the block before it."""
    found, end = [], 0
    for m in _FENCE.finditer(text):
        marker = _MARKER.search(text[end:m.start()])
        found.append(Block(m.group(1), m.group(2), marker.group(1) if marker else None,
                           text.count("\n", 0, m.start()) + 1))
        end = m.end()
    return found


_TEXT = README.read_text(encoding="utf-8")
SHELL_BLOCKS = [b for b in blocks(_TEXT) if b.lang in SHELLS]
RUN_BLOCKS = [b for b in SHELL_BLOCKS if b.kind != "network"]


def test_every_block_is_marked_as_it_must_be_run():
    every = blocks(_TEXT)
    assert RUN_BLOCKS and len(RUN_BLOCKS) < len(SHELL_BLOCKS)  # something runs, and the download does not
    assert all(b.lang for b in every), "a fenced block without a language"
    assert {b.kind for b in every} <= set(KINDS)
    assert _TEXT.count("readme-test:") == sum(b.marker is not None for b in every), "a marker belongs to no block"
    for b in RUN_BLOCKS:
        assert b.makes == (b.kind == "make"), f"README line {b.line}: a block with make commands needs `make`"


def _variant_dirs(dest: Path) -> dict[str, Path]:
    """Complete fixture model dirs under `dest`, by the variant their engine detects."""
    bare = sorted(p for p in fixtures_root().glob("cosyvoice/*/model") if p.is_dir())
    assert bare
    out = {}
    with Runtime() as rt:
        for d in bare:
            model = assemble_model_dir(d, dest / d.parent.name)
            for _engine, variant in rt.detect(model):
                out[variant or _engine] = model
    return out


def _lay_models(cwd: Path, names: set[str]) -> None:
    """Put a fixture model of the variant each name names at models/NAME (the variant is a prefix of the name)."""
    variants = _variant_dirs(cwd.parent / "fixture-models")
    for name in names:
        key = name.lower().removeprefix("fun-")
        matches = [v for v in variants if key.startswith(v.lower())]
        assert matches, f"no fixture model stands in for models/{name} (variants: {', '.join(variants)})"
        target = cwd / "models" / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(variants[max(matches, key=len)], target, symlinks=True)


def _script(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def _environment(tmp: Path, cwd: Path, port: int) -> tuple[dict, Path]:
    """The reader's shell: make on PATH, mizuoto and python only once .venv is activated; returns (env, make log)."""
    venv_bin = tmp / "venv-bin"
    python = _script(venv_bin / "python", f'exec "{sys.executable}" "$@"\n')
    _script(venv_bin / "mizuoto", f'exec "{sys.executable}" -m mizuoto.cli "$@"\n')
    (cwd / ".venv" / "bin").mkdir(parents=True)
    (cwd / ".venv" / "bin" / "activate").write_text(f'PATH="{venv_bin}:$PATH"; export PATH\n')
    stamps = [tmp / "installed", tmp / "installed-test"]
    for stamp in stamps:  # newer than the Makefile's inputs: make prints no install step
        stamp.touch()
        time.sleep(0.01)
    log = tmp / "make-test.log"
    real_make = shutil.which("make")
    assert real_make, "make is not installed"
    _script(tmp / "tools" / "make", f"""\
recipe=$("{real_make}" -s -n --no-print-directory -C "{_REPO}" PY="{python}" STAMP="{stamps[0]}" \\
    TEST_STAMP="{stamps[1]}" "$@") || exit $?
case "$recipe" in *" -m pytest"*) printf '%s\\n' "$recipe" >> "{log}"; exit 0 ;; esac
exec sh -c "$recipe"
""")
    # The reader's PATH holds no mizuoto until the README activates the venv.
    path = [str(tmp / "tools")] + [p for p in os.environ.get("PATH", "").split(os.pathsep)
                                   if p and not (Path(p) / "mizuoto").exists()]
    plugins = [str(p) for p in sorted((_REPO / "plugins").glob("*")) if (p / "pyproject.toml").is_file()]
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "VIRTUAL_ENV")}
    # make installs this checkout and its plugins; PYTHONPATH stands in for those installs.
    env.update(PATH=os.pathsep.join(path), PYTHONPATH=os.pathsep.join([str(_REPO), *plugins]),
               MIZUOTO_PORT=str(port), PYTHONUNBUFFERED="1")
    return env, log


def _run(block: Block, cwd: Path, env: dict, port: int, log: Path) -> None:
    text = block.text.replace("localhost:8000", f"localhost:{port}")
    with open(log, "w") as out:
        proc = subprocess.Popen(["bash", "-e", "-c", text], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=900)
        finally:
            try:  # whatever the block left running (a server when it failed before `kill`)
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
    assert code == 0, f"README block at line {block.line} exited {code}:\n{tail}"


def test_the_readme_runs_as_written(tmp_path):
    cwd = tmp_path / "checkout"
    cwd.mkdir()
    _lay_models(cwd, {m for b in RUN_BLOCKS for m in _MODEL.findall(b.text)})
    port = free_port()
    env, make_log = _environment(tmp_path, cwd, port)
    for i, block in enumerate(RUN_BLOCKS):
        _run(block, cwd, env, port, tmp_path / f"block-{i}.log")
    outputs = {o for b in RUN_BLOCKS for o in _OUTPUT.findall(b.text)} | {"demo.wav"}
    for name in sorted(outputs):
        info = soundfile.info(cwd / name)  # raises unless the README's command wrote real audio there
        assert info.frames > 0, name
    makes_test = [b for b in RUN_BLOCKS if re.search(r"^\s*make test\b", b.text, re.M)]
    recorded = make_log.read_text().splitlines() if make_log.exists() else []
    # `make test` checks the browser (an apt install on a fresh machine), then runs the suite: once per block
    assert sum(" -m pytest" in r for r in recorded) == len(makes_test), recorded

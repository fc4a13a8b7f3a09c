"""`make demo`: speak one sentence into demo.wav with any model directory an installed engine detects.

`make demo MODEL=DIR REF=clip.wav REF_TEXT="..."` runs `python -m mizuoto.demo DIR --ref-audio clip.wav
--ref-text "..."`. Without a directory the demo speaks with the voice a plugin offers for demos (the
Piper plugin's en_US voice). A model with preset voices speaks with its first one; a model without
clones the reference clip, or, given none, a reference the demo makes itself: a sentence spoken by
the demo voice, with its transcript, kept beside the output. Every failure is one line on stderr
with the command that fixes it; --debug shows the traceback.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from mizuoto.cli.main import write_wav
from mizuoto.errors import MizuotoError
from mizuoto.runtime.api import Runtime
from mizuoto.runtime.engine import Reference, SynthesisRequest, check_request
from mizuoto.runtime.hub import resolve_model
from mizuoto.runtime.options import LoadOptions, add_load_arguments, options_from_args

TEXT = "Hello from Mizuoto, a speech runtime that hosts several voices behind one API."
REFERENCE_TEXT = "This is the demo voice, reading a short sentence for another model to clone."
INSTRUCT = "Speak in a calm, friendly voice."  # for models whose preset voices speak only with an instruction
OUTPUT = Path("demo.wav")
INSTALL_PIPER = "pip install -e plugins/mizuoto-piper"


class DemoError(MizuotoError):
    """A demo that cannot run, with the command that fixes it."""


class _Commands:
    """The fixing commands, spelled as the user ran the demo: `make demo ...` or `python -m mizuoto.demo ...`."""

    def __init__(self, make: bool, model: Path | None):
        self.make, self.model = make, model

    def demo(self, model: str | None = None, ref: str | None = None, ref_text: str | None = None) -> str:
        """The demo command line with these arguments (the model defaults to the one given)."""
        model = model if model is not None else (str(self.model) if self.model is not None else None)
        if self.make:
            parts = [f"{k}={shlex.quote(v)}" for k, v in (("MODEL", model), ("REF", ref), ("REF_TEXT", ref_text)) if v]
            return " ".join(["make demo", *parts])
        parts = [shlex.quote(model)] if model else []
        parts += [f"--ref-audio {shlex.quote(ref)}"] if ref else []
        parts += [f"--ref-text {shlex.quote(ref_text)}"] if ref_text else []
        return " ".join(["python -m mizuoto.demo", *parts])

    def clone(self) -> str:
        """The demo command that clones a clip of the user's own."""
        return self.demo(ref="clip.wav", ref_text="what the clip says")

    @property
    def debug(self) -> str:
        return "make demo ... DEBUG=1" if self.make else "python -m mizuoto.demo ... --debug"


def _fail(error: MizuotoError, fix: str) -> DemoError:
    return DemoError(f"{' '.join(str(error).split())}; to fix: {fix}")


def demo_voice(rt: Runtime) -> Path:
    """The model directory the installed plugins offer for demos (the Piper voice), or a clear error."""
    offered = [Path(d) for d in rt.registry.example_models() if Path(d).is_dir() and rt.detect(d)]
    if not offered:
        raise DemoError(f"no plugin offers a demo voice (the Piper plugin does); to fix: {INSTALL_PIPER}"
                        " (make demo installs it)")
    return offered[0]


def _load(rt: Runtime, model_dir: Path, options: LoadOptions, commands: _Commands) -> str:
    try:
        return rt.load(model_dir, **options.as_dict())
    except MizuotoError as e:
        if not model_dir.is_dir():
            raise _fail(e, f"download a model (README: 'Get a model directory'), then run "
                           f"{commands.demo(model='path/to/model')}") from e
        if not rt.detect(model_dir):
            raise _fail(e, "point it at the folder that holds the model's own files (`mizuoto engines` lists the"
                           " installed engines)") from e
        raise _fail(e, f"download the complete model directory (README: 'Get a model directory'), then run "
                       f"{commands.demo()}") from e


def _presets(rt: Runtime, name: str) -> list[str]:
    return [v.id for v in rt.voices(name) if v.kind == "preset"]


def _request(rt: Runtime, name: str, text: str, voice: str | Reference) -> SynthesisRequest:
    """A request for `voice` in a mode the model has (an instruction added where presets need one)."""
    modes = rt.model(name).capabilities.modes
    instruct = INSTRUCT if isinstance(voice, str) and "preset" not in modes and "instruct" in modes else None
    return check_request(SynthesisRequest(text, voice=voice, instruct=instruct, seed=0), rt.model(name),
                         str(rt.info(name).path))


def _make_reference(rt: Runtime, model: str, out: Path, options: LoadOptions,
                    commands: _Commands) -> tuple[Reference, str]:
    """A reference clip spoken by the demo voice, kept beside `out`; returns it and how it was made."""
    model_dir = rt.info(model).path
    modes = rt.model(model).capabilities.modes
    if not modes & {"clone", "cross_lingual"}:
        raise DemoError(f"{model_dir} has no preset voice and cannot clone one (modes: {', '.join(sorted(modes))})")
    try:
        voice_dir = demo_voice(rt)
    except DemoError:
        raise DemoError(f"{model_dir} has no preset voice, and no demo voice is installed to make a reference;"
                        f" to fix: {commands.clone()} (or {INSTALL_PIPER}, and the demo makes one)") from None
    name = _load(rt, voice_dir, options, commands)
    try:
        voice = _presets(rt, name)[0]
        info = rt.info(name)
        path = out.with_name(f"{out.stem}-reference.wav")
        write_wav(path, rt.synthesize(name, _request(rt, name, REFERENCE_TEXT, voice)))
    finally:
        rt.unload(name)
    print(f"demo: {model_dir} has no preset voice, so the demo made a reference to clone: {REFERENCE_TEXT!r}"
          f" spoken by the {info.engine} voice {voice}, in {path.resolve()}")
    return Reference(str(path), REFERENCE_TEXT), f"a clone of the demo's reference {path.name}"


def speak(args: argparse.Namespace) -> str:
    """Write the demo wav as `args` say; returns what was used, for the user."""
    commands = _Commands(args.as_make, args.model_dir)
    out = args.output
    try:
        options = options_from_args(args)
    except MizuotoError as e:
        raise _fail(e, f"leave the option out: {commands.demo(ref=args.ref_audio, ref_text=args.ref_text)}") from e
    if args.ref_text is not None and args.ref_audio is None:
        raise DemoError(f"a reference transcript needs its clip; to fix: {commands.clone()}")
    try:
        given = Reference(args.ref_audio, args.ref_text) if args.ref_audio else None
    except MizuotoError as e:
        raise _fail(e, commands.clone().replace("clip.wav", "path/to/existing-clip.wav")) from e
    with Runtime() as rt:
        # a directory, or the short id of a model a plugin offers (MODEL=en_US-joe-medium, the Piper voice)
        model_dir = resolve_model(str(args.model_dir)) if args.model_dir is not None else demo_voice(rt)
        name = _load(rt, model_dir, options, commands)
        # the default voice and a short id are shown by name; a directory given as such, as given
        shown = name if args.model_dir is None or model_dir != args.model_dir else model_dir
        info, presets = rt.info(name), _presets(rt, name)
        if given is not None:
            voice, how = given, f"a clone of {args.ref_audio}"
        elif presets:
            voice, how = presets[0], f"its preset voice {presets[0]}"
        else:
            voice, how = _make_reference(rt, name, out, options, commands)
        try:
            request = _request(rt, name, args.text, voice)
        except MizuotoError as e:
            fix = commands.demo() if given is not None and presets else commands.clone()
            raise _fail(e, fix) from e
        seconds, rate, _ = write_wav(out, rt.synthesize(name, request))
    variant = f" ({info.variant})" if info.variant else ""
    return (f"wrote {out.resolve()} ({seconds:.2f} s at {rate} Hz) with {shown}: engine {info.engine}{variant}"
            f" on {info.device}, mode {request.mode}, voice: {how}")


def build_parser() -> argparse.ArgumentParser:
    """The demo's arguments."""
    parser = argparse.ArgumentParser(prog="python -m mizuoto.demo", description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", nargs="?", type=Path,
                        help="a model directory, or a plugin's model id (default: the demo voice, en_US-joe-medium)")
    parser.add_argument("--ref-audio", help="reference clip to clone (models without preset voices)")
    parser.add_argument("--ref-text", help="transcript of the reference clip")
    parser.add_argument("--text", default=TEXT, help="what to say (default: a sentence about Mizuoto)")
    parser.add_argument("-o", "--output", type=Path, default=OUTPUT, help=f"output wav (default: {OUTPUT})")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    parser.add_argument("--as-make", action="store_true", help=argparse.SUPPRESS)  # fixes are spelled as make demo
    add_load_arguments(parser)
    return parser


def main(argv: list[str] | None = None, out: Path = OUTPUT) -> int:
    """Write the demo wav; returns the exit code."""
    parser = build_parser()
    parser.set_defaults(output=out)
    args = parser.parse_args(argv)
    try:
        used = speak(args)
    except Exception as e:
        if args.debug:
            raise
        debug = _Commands(args.as_make, args.model_dir).debug
        if not isinstance(e, MizuotoError):
            kind, hint = f"internal error ({type(e).__name__})", f" (run {debug} for the traceback)"
        else:  # a DemoError names its fix; an error before any step could name one points to the details
            kind, hint = "error", "" if isinstance(e, DemoError) else f"; run {debug} for details"
        print(f"demo: {kind}: {' '.join(str(e).split())}{hint}", file=sys.stderr)
        return 1
    print(f"demo: {used}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`mizuoto say` and `mizuoto engines` with a Chatterbox directory: request options from the command line."""

import soundfile


def test_say_speaks_with_the_models_options(case, tmp_path, capsys):
    from mizuoto.cli.main import main

    if case.clip is not None or "expected_error" in case.spec:
        return
    out = tmp_path / "out.wav"
    option = "temperature=0.7"
    assert main(["say", case.spec["text"], "-m", str(case.model_dir), "-o", str(out), "--seed", "3",
                 "--param", option, "--option", "watermark=false"]) == 0, capsys.readouterr().err
    audio, rate = soundfile.read(out)
    assert rate == 24000 and len(audio) > 0
    assert "chatterbox engine" in capsys.readouterr().out


def test_a_bad_option_is_one_line_naming_it(case, tmp_path, capsys):
    from mizuoto.cli.main import main

    if case.clip is not None:
        return
    assert main(["say", "Hello.", "-m", str(case.model_dir), "-o", str(tmp_path / "x.wav"),
                 "--param", "loudness=3"]) == 1
    err = capsys.readouterr().err
    assert "no option 'loudness'" in err and "temperature" in err and err.count("\n") == 1


def test_engines_lists_the_options(capsys):
    from mizuoto.cli.main import main

    assert main(["engines"]) == 0
    out = capsys.readouterr().out
    assert "chatterbox" in out and "--param cfg_weight: float" in out

"""`mizuoto bench` on a Chatterbox directory: the engine's own stage calls timed, exactly the tokens asked for."""

import json


def test_bench_times_the_engines_calls_and_streams(case, capsys):
    from mizuoto.cli.main import main

    if case.clip is not None or "expected_error" in case.spec:
        return
    assert main(["bench", str(case.model_dir), "--tokens", "6", "--runs", "1", "--warmup", "0", "--stream",
                 "--json"]) == 0, capsys.readouterr().err
    out = json.loads(capsys.readouterr().out)
    # two mel frames a token, less one where the voice's prompt mel has an odd length (40 ms a token)
    assert out["tokens"] == 6 and 6 / 25 - 0.02 <= out["audio_seconds"] <= 6 / 25
    assert out["lm_ms_per_token"] > 0 and out["flow_ms_per_audio_second"] > 0 and out["first_chunk_ms"] > 0
    assert out["model"].startswith("chatterbox")

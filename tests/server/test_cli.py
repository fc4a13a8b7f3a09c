"""`mizuoto serve` as a process: flags from MIZUOTO_* variables, and graceful shutdown on SIGTERM mid-stream."""

import os
import signal
import subprocess
import sys
import time

import httpx

from mizuoto.server.launch import free_port


def _wait_up(url: str, proc, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, proc.stderr.read().decode()
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("server did not come up")


def test_serve_env_and_graceful_shutdown(tmp_path, h):
    """Port, models and limits from the environment; SIGTERM lets an in-flight stream finish, then exits 0."""
    port = free_port()
    slow = h.write_slow_model(tmp_path / "slow", 0.1)
    env = {**os.environ, "MIZUOTO_PORT": str(port), "MIZUOTO_MODELS": f"slow={slow}", "MIZUOTO_MAX_CONCURRENT": "3",
           "MIZUOTO_DEVICE": "cpu", "MIZUOTO_LOG_LEVEL": "warning"}
    # The test-only 'slow' engine is not registered in a fresh process; serve it through a tiny launcher.
    launcher = tmp_path / "launch.py"
    launcher.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(os.path.dirname(__file__))!r})\n"
        "import conftest, mizuoto.runtime.api as api\n"
        "_Runtime = api.Runtime\n"
        "api.Runtime = lambda **kw: _Runtime(engines=(conftest.SlowToneEngine,), **kw)\n"
        "from mizuoto.cli.serve import main\n"
        "sys.exit(main(['serve']))\n")
    proc = subprocess.Popen([sys.executable, str(launcher)], env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_up(url, proc)
        assert "mizuoto_max_concurrent 3" in httpx.get(url + "/metrics").text
        with httpx.stream("POST", url + "/v1/audio/speech", timeout=30,
                          json={"model": "slow", "input": "abcd" * 6, "stream_format": "audio",
                                "response_format": "pcm"}) as r:
            assert r.status_code == 200
            it = r.iter_raw()
            received = len(next(it))
            proc.send_signal(signal.SIGTERM)
            received += sum(len(p) for p in it)
        assert received == 2 * 24 * 960  # every sample of the stream arrived before the server stopped
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_bad_flags(tmp_path, capsys):
    """A missing model directory or a zero limit is a one-line error and exit code 1."""
    from mizuoto.cli.serve import main

    assert main(["serve", "-m", str(tmp_path / "nope"), "--port", str(free_port())]) == 1
    assert "model directory not found" in capsys.readouterr().err
    assert main(["serve", "--max-concurrent", "0"]) == 1
    assert "--max-concurrent" in capsys.readouterr().err
    assert main(["serve", "--max-batch", "0"]) == 1
    assert "--max-batch" in capsys.readouterr().err
    for spec in ("x=", "=" + str(tmp_path)):  # an empty directory or name: not the working directory
        assert main(["serve", "-m", spec, "--port", str(free_port())]) == 1
        err = capsys.readouterr().err
        assert "give a model directory, as DIR or NAME=DIR" in err and "Traceback" not in err


def test_max_batch_sets_the_models_batch_width_and_the_job_limit():
    """--max-batch N is the load option compute.batch (an explicit --option wins) and raises the job limit to N."""
    import argparse

    from mizuoto.cli.serve import add_serve_arguments, shared_config

    def config(*argv):
        p = argparse.ArgumentParser()
        add_serve_arguments(p)
        return shared_config(p.parse_args(list(argv)))

    plain = config("--device", "cpu")
    assert plain["max_concurrent"] == 4 and plain["load_options"]["compute"]["batch"] == 1
    batched = config("--device", "cpu", "--max-batch", "8")
    assert batched["max_concurrent"] == 8 and batched["load_options"]["compute"]["batch"] == 8
    assert config("--device", "cpu", "--max-batch", "8", "--max-concurrent", "2")["max_concurrent"] == 2
    explicit = config("--device", "cpu", "--max-batch", "8", "--option", "compute.batch=2")
    assert explicit["load_options"]["compute"]["batch"] == 2

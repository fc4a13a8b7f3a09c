"""`mizuoto serve` as a process: flags from MIZUOTO_* variables, and graceful shutdown on SIGTERM mid-stream."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

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


def _launcher(tmp_path) -> Path:
    """A script running `mizuoto ARGS...` with the test-only 'slow' engine registered (a fresh process lacks it)."""
    launcher = tmp_path / "launch.py"
    launcher.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(os.path.dirname(__file__))!r})\n"
        "import conftest, mizuoto.runtime.api as api\n"
        "_Runtime = api.Runtime\n"
        "api.Runtime = lambda **kw: _Runtime(engines=(conftest.SlowToneEngine,), **kw)\n"
        "from mizuoto.cli.main import main\n"
        "sys.exit(main(sys.argv[1:]))\n")
    return launcher


def test_serve_env_and_graceful_shutdown(tmp_path, h):
    """Port, models and limits from the environment; SIGTERM lets an in-flight stream finish, then exits 0."""
    port = free_port()
    slow = h.write_slow_model(tmp_path / "slow", 0.1)
    env = {**os.environ, "MIZUOTO_PORT": str(port), "MIZUOTO_MODELS": f"slow={slow}", "MIZUOTO_MAX_CONCURRENT": "3",
           "MIZUOTO_DEVICE": "cpu", "MIZUOTO_LOG_LEVEL": "warning"}
    proc = subprocess.Popen([sys.executable, str(_launcher(tmp_path)), "serve"], env=env, stderr=subprocess.PIPE,
                            stdout=subprocess.PIPE)
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


def _launch(h, tmp_path, port: int, *argv: str) -> subprocess.Popen:
    """`mizuoto serve` on `port` serving a 'slow' tone model (registered by a launcher), its output as text pipes."""
    slow = h.write_slow_model(tmp_path / "slow", 0.0)
    launcher = _launcher(tmp_path)
    env = {**os.environ, "MIZUOTO_PORT": str(port), "MIZUOTO_MODELS": f"slow={slow}", "MIZUOTO_DEVICE": "cpu",
           "MIZUOTO_DRAIN_SECONDS": "0"}
    env.pop("MIZUOTO_LOG_LEVEL", None)
    return subprocess.Popen([sys.executable, str(launcher), "serve", *argv], env=env, text=True,
                            stderr=subprocess.PIPE, stdout=subprocess.PIPE)


def _stop(proc) -> tuple[str, str]:
    """SIGTERM, then (stdout, stderr) once it has exited (0)."""
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    return out, err


def test_serve_says_what_it_loads_where_it_listens_and_logs_each_request(tmp_path, h):
    """At the default level: a line per model as it loads (name, engine, device, seconds) and one with the address
    when ready, on stderr; uvicorn's access log on stdout; a request naming no format gets mp3 (OpenAI's default)."""
    port = free_port()
    proc = _launch(h, tmp_path, port, "--alias", "tts-1=slow", "--voice-alias", "alloy=high")
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_up(url, proc)
        r = httpx.post(url + "/v1/audio/speech", json={"model": "tts-1", "input": "abc", "voice": "alloy"}, timeout=30)
        assert r.status_code == 200 and r.headers["content-type"] == "audio/mpeg"
        assert r.content[:3] == b"ID3" or (r.content[0] == 0xFF and r.content[1] & 0xE0 == 0xE0), r.content[:8]
        out, err = _stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "mizuoto: INFO: loading model slow ..." in err
    assert re.search(r"^mizuoto: INFO: loaded model slow \(slow on cpu\) in \d+\.\d s$", err, re.M), err
    assert f"mizuoto: INFO: ready on {url} (models: slow; alias tts-1 -> slow); the web page is at {url}/" in err
    assert err.index("loaded model slow") < err.index("ready on")
    assert re.search(r'"GET /ready HTTP/1.1" (200|503)', out) and '"POST /v1/audio/speech HTTP/1.1" 200' in out, out


def test_serve_without_access_log_at_warning_is_quiet(tmp_path, h):
    """--no-access-log and --log-level warning: no request lines, no start-up lines."""
    port = free_port()
    proc = _launch(h, tmp_path, port, "--no-access-log", "--log-level", "warning")
    try:
        _wait_up(f"http://127.0.0.1:{port}", proc)
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).status_code == 200
        out, err = _stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "HTTP/1.1" not in out + err and "loaded model" not in err and "ready on" not in err, (out, err)


def test_serve_without_a_model_refuses_to_start(monkeypatch, capsys, tmp_path, h):
    """No -m: a one-line error that says how to give one (the README's wait for /ready cannot hang on it); a model
    root with an admin key may start empty. A bad --log-level, --default-format or --alias is refused too."""
    from mizuoto.cli.main import main

    for name in ("MIZUOTO_MODELS", "MIZUOTO_MODEL_ROOTS", "MIZUOTO_ADMIN_KEY", "MIZUOTO_LOG_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    assert main(["serve", "--port", str(free_port())]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mizuoto: error: no model to serve: give one with -m [NAME=]DIR") and err.count("\n") == 1
    assert "--model-root DIR and --admin-key KEY" in err
    assert main(["serve", "--model-root", str(tmp_path), "--port", str(free_port())]) == 1  # no admin key
    assert "no model to serve" in capsys.readouterr().err
    slow = h.write_slow_model(tmp_path / "slow", 0.0)
    for flags, message in ((["--log-level", "loud"], "--log-level 'loud': use one of"),
                           (["--default-format", "ogg"], "--default-format 'ogg' cannot be written here"),
                           (["--alias", "tts-1=nope"], "--alias tts-1=nope: no served model is named 'nope'")):
        assert main(["serve", "-m", f"slow={slow}", "--port", str(free_port()), *flags]) == 1
        assert message in capsys.readouterr().err

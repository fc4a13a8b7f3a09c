"""The server is an optional extra: the core and the serve command import without Starlette or uvicorn."""

import subprocess
import sys


def test_core_imports_without_server_extra():
    """With starlette and uvicorn unimportable, the core, the CLI and `serve --help` still work."""
    code = ("import sys; sys.modules['starlette'] = None; sys.modules['uvicorn'] = None\n"
            "import mizuoto.runtime.api, mizuoto.cli.main, mizuoto.server, mizuoto.cli.serve\n"
            "from mizuoto.cli.serve import main\n"
            "sys.exit(main(['serve', '--port', '1']))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert "needs the server extra: pip install 'mizuoto-runtime[server]'" in r.stderr

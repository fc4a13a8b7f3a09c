"""Pytest plugin: run the suite with MKL on the code paths of the CPU the fixtures were recorded on.

The parity fixtures were recorded where MKL dispatched to its Intel kernels. On other x86 CPUs
(AMD) the same torch binary picks other sgemm/FFT kernels, which round differently in the last
bit; then nothing downstream can be `torch.equal`. MKL asks one function,
`mkl_serv_intel_cpu_true`, which kernels to use; a one-line LD_PRELOAD library answering 1
makes it choose the recording machine's kernels. Loaded early (`-p mizuoto.testing.mkl_intel`
in the pytest options), before pytest captures output, this module builds that library once
and re-executes the test process with it preloaded. Nothing outside the test suite uses it.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

_ENV_FLAG = "MIZUOTO_MKL_INTEL"
_SOURCE = "int mkl_serv_intel_cpu_true(void) { return 1; }\n"


def mkl_on_intel_path() -> bool:
    """Whether torch's MKL already takes its Intel code paths (or there is no MKL to steer)."""
    try:
        return bool(ctypes.CDLL(None).mkl_serv_intel_cpu_true())  # a preloaded shim answers here
    except AttributeError:
        pass
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return True
    lib = Path(spec.origin).parent / "lib" / "libtorch_cpu.so"
    try:
        return bool(ctypes.CDLL(str(lib)).mkl_serv_intel_cpu_true())
    except (OSError, AttributeError):
        return True


def build_shim(folder: Path) -> Path | None:
    """Compile the one-line library into `folder`; None when no C compiler is available."""
    lib = folder / "libmizuoto_mkl_intel.so"
    if lib.is_file():
        return lib
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    src = folder / "mkl_intel.c"
    src.write_text(_SOURCE)
    tmp = folder / f".{lib.name}.{os.getpid()}"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(tmp), str(src)], check=True)
    os.replace(tmp, lib)
    return lib


def _reexec() -> None:
    if os.environ.get(_ENV_FLAG) or sys.platform != "linux" or mkl_on_intel_path():
        return
    lib = build_shim(Path(tempfile.gettempdir()) / f"mizuoto-mkl-{os.getuid()}")
    if lib is None:
        print("mizuoto: MKL is not on its Intel code path and no C compiler is available; "
              "exact parity tests will fail on this CPU", file=sys.stderr)
        return
    env = dict(os.environ, **{_ENV_FLAG: "1"})
    # Idle OpenMP threads sleep instead of spinning: same numerics, far less wall time on a busy
    # 2-core machine; it must be set before torch starts its threads, which the re-exec allows.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env["LD_PRELOAD"] = ":".join(p for p in (str(lib), env.get("LD_PRELOAD", "")) if p)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)


_reexec()


def require_intel_path() -> None:
    """Fail (never skip) a bit-exact parity check when MKL is off the recording machine's code paths."""
    assert mkl_on_intel_path(), (
        "MKL is not on its Intel code paths in this process, so bit-exact parity with the fixtures "
        "(recorded on those paths) cannot hold: run pytest with the repo's options (pyproject adds "
        "`-p mizuoto.testing.mkl_intel`, which needs a C compiler on non-Intel CPUs)")

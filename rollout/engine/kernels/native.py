"""Native kernels: C sources next to this module (decode_kernel.c), compiled once per machine on first use.

Each is built with the system's C compiler (`$CC`, else `cc`; ~0.5 s) into `$ROLLOUT_KERNEL_CACHE` (default
`~/.cache/rollout/kernels`), keyed by the source, the flags and the CPU's feature flags (it is built with
`-march=native`), built aside and renamed into place so processes starting together are safe. No compiler, a failed
build or `ROLLOUT_<NAME>=0` (e.g. `ROLLOUT_DECODE_KERNEL=0`): `load` is None, with a warning saying why, and the caller
keeps its torch path. `pip install` needs no compiler.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fPIC", "-shared")


def source(name: str) -> Path:
    return Path(__file__).with_name(f"{name}.c")


@functools.lru_cache(maxsize=None)
def load(name: str, flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The built library of `name`.c (with `flags` past FLAGS), or None where it cannot be had here."""
    if os.environ.get(f"ROLLOUT_{name.upper()}", "1") == "0":
        return None
    try:
        return ctypes.CDLL(str(build(name, flags)))
    except (OSError, subprocess.SubprocessError, RuntimeError) as error:
        warnings.warn(f"rollout: the native kernel {name!r} could not be built ({error}); the engine keeps its torch "
                      "path (correct, slower). Fix: install a C compiler (cc/gcc) or set CC, and let "
                      "ROLLOUT_KERNEL_CACHE name a writable folder.", RuntimeWarning, stacklevel=2)
        return None


def build(name: str, flags: tuple[str, ...] = ()) -> Path:
    """The shared library of `name`.c for this machine, compiled if it is not in the cache yet."""
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler {compiler!r} on PATH")
    code = source(name).read_bytes()
    machine = cpuinfo("flags", "Features")  # -march=native: a build runs on CPUs with these features
    flags = FLAGS + tuple(flags)
    key = hashlib.sha256(code + " ".join(flags).encode() + compiler.encode() + machine.encode()).hexdigest()
    root = Path(os.environ.get("ROLLOUT_KERNEL_CACHE") or Path.home() / ".cache" / "rollout" / "kernels")
    target = root / f"{name}-{key[:16]}.so"
    if target.exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as scratch:  # built aside, then renamed: concurrent builders are safe
        built = Path(scratch) / target.name
        result = subprocess.run([compiler, *flags, "-o", str(built), str(source(name)), "-lpthread", "-lm"],
                                capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-400:]}")
        os.replace(built, target)
    return target


def cpuinfo(*keys: str) -> str:
    """The value of the first /proc/cpuinfo line whose key is one of `keys` ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                key, _, value = line.partition(":")
                if key.strip() in keys:
                    return value.strip()
    except OSError:
        pass
    return ""

"""The native library's build and load (the C sources under csrc/, one header csrc/mls.h): built once per
machine with the system C compiler, loaded with ctypes, and optional: without a compiler (or with kernels="torch") every
product takes the pure-torch reference path, which the tests hold the native one to.

The library is built at first use, not at install time, so that `pip install` needs no compiler
and no torch headers; the build takes about a second (one translation unit, csrc/mls.c, which includes the
others: csrc/mls.c says why). It is compiled for this CPU (-march=native), so the cache key includes the
CPU's flags as well as every source and header and the compiler: a home folder shared between machines gets
one library per kind of CPU. Threads come from OpenMP: the library
links libgomp, which resolves to the copy torch has already loaded, so torch.set_num_threads
governs both and the process has one thread pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from mlaserve.config.cpu import cpu_flags
from mlaserve.kernels import native_abi

CSRC = Path(__file__).with_name("csrc")
SOURCE = CSRC / "mls.c"  # the translation unit; it includes every other file under CSRC
HEADER = CSRC / "mls.h"  # the interface native_abi.py mirrors (tests/kernels/test_kernel_bindings.py checks the mirror)
ABI_VERSION = 46  # mls.h MLS_ABI_VERSION: the functions and signatures below
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
# compiler flags appended to FLAGS, e.g. "-mno-avx512f": the AVX2 kernels on an AVX-512 CPU (a benchmark's or a
# bug report's other target; the build's isa() and the kernel plan then name it)
EXTRA_FLAGS = "MLASERVE_KERNEL_CFLAGS"

_lock = threading.Lock()
_state: dict[str, object] = {}


@dataclass(frozen=True)
class NativeStatus:
    available: bool
    detail: str  # the library's path, or why it is not there


def _cpu_flags() -> str:
    return " ".join(sorted(cpu_flags()))


def _cache_dir() -> Path:
    base = os.environ.get("MLASERVE_CACHE") or os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mlaserve" / "kernels"


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def _sources_digest() -> bytes:
    """Every file under csrc/ (name and bytes): the key changes with any source or header the build reads."""
    h = hashlib.sha256()
    for f in sorted(p for p in CSRC.rglob("*") if p.is_file()):
        h.update(f.relative_to(CSRC).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.digest()


def _build(extra_flags: tuple[str, ...] = ()) -> tuple[ctypes.CDLL | None, str]:
    """extra_flags: appended to FLAGS (the tests build an AVX2-only variant on AVX-512 machines with
    -mno-avx512f, so that both code paths are held to the reference wherever the suite runs)."""
    cc = _compiler()
    if cc is None:
        return None, "no C compiler on PATH (set CC, or install gcc): using the torch path"
    flags = (*FLAGS, *extra_flags)
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.split("\n", 1)[0]
    key = hashlib.sha256(_sources_digest() + version.encode() + " ".join(flags).encode() + _cpu_flags().encode())
    out = _cache_dir() / f"mls-{key.hexdigest()[:16]}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        run = subprocess.run([cc, *flags, str(SOURCE), "-lm", "-o", tmp], capture_output=True, text=True)
        if run.returncode != 0:
            os.unlink(tmp)
            return None, f"{cc} could not build {SOURCE.relative_to(CSRC.parent)}: {run.stderr.strip()[:400]}"
        os.replace(tmp, out)  # atomic: concurrent builders (tensor-parallel ranks) agree
    lib = ctypes.CDLL(str(out))
    if lib.mls_abi_version() != ABI_VERSION:
        return None, f"{out}: unexpected ABI version"
    native_abi.declare(lib)
    return lib, str(out)


def library() -> ctypes.CDLL | None:
    with _lock:
        if "lib" not in _state:
            try:
                _state["lib"], _state["detail"] = _build(tuple(os.environ.get(EXTRA_FLAGS, "").split()))
            except OSError as e:  # an unwritable cache folder, a library that will not load
                _state["lib"], _state["detail"] = None, f"native kernels unavailable: {e}"
        return _state["lib"]  # type: ignore[return-value]


def status() -> NativeStatus:
    lib = library()
    return NativeStatus(lib is not None, str(_state["detail"]))


def isa() -> str:
    """The instruction set the library's kernels were built for ("avx512", "avx2", "scalar": csrc/common.h picks
    them from the build's target, -march=native), for the kernel plan; "" without the library."""
    lib = library()
    return ctypes.string_at(lib.mls_isa()).decode() if lib is not None else ""

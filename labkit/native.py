"""The engine's small C kernels: compiled at first use for this CPU, cached, loaded with ctypes.

A kernel is one C file next to the module that calls it. It is compiled with the system's C compiler
(`cc`, or `$CC`) and flags for this CPU's vector extension (AVX-512, AVX2, NEON or generic), into a
per-user cache directory (`$LABKIT_CACHE_DIR`, else the platform's user cache) under a name keyed by
the source, compiler, flags and CPU. The library is written to a temporary file and renamed into
place, so two processes building at once never load a half-written file. A caller that cannot get
its library (no compiler, a failed build) keeps a torch path and says why in the benchmark output.
"""

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch


class BuildError(RuntimeError):
    """Why a kernel could not be built, in one short line (shown where the kernel's name would be)."""


def find_c_compiler() -> str | None:
    """The C compiler to build with: `$CC` if set, else `cc`; None when there is none."""
    return shutil.which(os.environ.get("CC", "cc"))


def x86_flags() -> set[str]:
    """The CPU feature flags Linux lists in /proc/cpuinfo (empty elsewhere)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def cpu_target() -> tuple[str, list[str]]:
    """(a name for this CPU's vector ISA, the compiler flags that target it, with LANES: the floats in
    one register of that ISA). On AVX-512 CPUs with VNNI (int8 dot products) the flag that enables it
    is added and the name says so; kernels test `__AVX512VNNI__`."""
    machine = platform.machine().lower()
    if machine in ("arm64", "aarch64"):
        # NEON is in every AArch64 CPU. Not -mcpu=native: the cache key names the flags, not the exact
        # CPU, and one home directory may serve different ARM machines.
        flag = "-mcpu=apple-m1" if sys.platform == "darwin" else "-march=armv8-a"
        return "NEON", [flag, "-DLANES=4"]
    capability = torch.backends.cpu.get_cpu_capability()  # torch's own dispatch choice: AVX512, AVX2, ...
    if capability == "AVX512":
        if "avx512_vnni" in x86_flags():
            return "AVX-512 VNNI", ["-march=x86-64-v4", "-mavx512vnni", "-mprefer-vector-width=512", "-DLANES=16"]
        return "AVX-512", ["-march=x86-64-v4", "-mprefer-vector-width=512", "-DLANES=16"]
    if capability == "AVX2":
        return "AVX2", ["-march=x86-64-v3", "-DLANES=8"]
    return "generic", ["-DLANES=4"]


def cache_dir() -> Path:
    if os.environ.get("LABKIT_CACHE_DIR"):
        return Path(os.environ["LABKIT_CACHE_DIR"])
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "labkit"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "labkit"


def build(source: Path, includes: tuple[Path, ...] = (), extra_flags: tuple[str, ...] = ()) -> tuple[ctypes.CDLL, str]:
    """Compile `source` for this CPU (or reuse the cached build) and load it: (library, target name).
    `includes`: the C files `source` #includes, so that editing them rebuilds it too; `extra_flags`:
    the extensions it needs beyond the CPU's vector ISA (e.g. AMX). Raises BuildError with the reason
    when there is no compiler or the build fails."""
    compiler = find_c_compiler()
    if compiler is None:
        raise BuildError("no C compiler")
    target, flags = cpu_target()
    command = [compiler, "-O3", "-shared", "-fPIC", *flags, *extra_flags]
    try:
        texts = [path.read_text() for path in (source, *includes)]
        key = hashlib.sha256("\0".join([*texts, *command, platform.machine()]).encode()).hexdigest()
        library = cache_dir() / f"{source.stem}-{key[:16]}.so"
        if not library.exists():
            library.parent.mkdir(parents=True, exist_ok=True)
            fd, partial = tempfile.mkstemp(suffix=".so", dir=library.parent)
            os.close(fd)
            try:
                subprocess.run([*command, "-o", partial, str(source)], check=True, capture_output=True, text=True,
                               timeout=120)
                os.replace(partial, library)  # atomic: another process sees no file or a whole one
            finally:
                if os.path.exists(partial):
                    os.unlink(partial)
        return ctypes.CDLL(str(library)), target
    except (OSError, subprocess.SubprocessError) as error:
        detail = (getattr(error, "stderr", None) or "").strip()
        raise BuildError(f"compiling {source.name} failed: {detail.splitlines()[-1] if detail else error}") from error


def loader(source: Path, bind, includes: tuple[Path, ...] = (), extra_flags: tuple[str, ...] = ()):
    """A cached function that builds `source` at its first call and returns `bind(library, target)`,
    or, when it cannot be built, the reason as a string (for the kernel's name in benchmark output).
    `.cache_clear()` forgets it, as tests do to build again."""
    @functools.cache
    def load():
        try:
            library, target = build(source, includes, extra_flags)
        except BuildError as error:
            return str(error)
        return bind(library, target)
    return load

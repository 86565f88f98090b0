"""How the engine's C kernels are built: compiled at first use for this CPU, cached, loaded with ctypes.

A kernel is one C file of this folder (with the files it `#include`s). It is compiled with the
system's C compiler (`cc`, or `$CC`) and flags for this CPU's vector extension (AVX-512, AVX2, NEON or
generic), into a per-user cache directory (`$LABKIT_CACHE_DIR`, else the platform's user cache) under
a name keyed by the source and every file it includes, the compiler, flags and CPU, so an edited
header never loads a stale library. The library is written to a temporary file and renamed into
place, so two processes building at once never load a half-written file. A caller that cannot get
its library (no compiler, a failed build) keeps a torch path, and `labkit.kernels.describe()` says why.
"""

import ctypes
import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
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


def cpu_features() -> str:
    """The CPU's widest matrix/vector extension, which decides the kernels: AMX-BF16, AVX512-BF16,
    AVX512, AVX2, NEON (Apple and other Arm) or none."""
    if platform.machine().lower() in ("arm64", "aarch64"):
        return "NEON"
    flags = x86_flags()
    for flag, name in (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16"), ("avx512f", "AVX512"),
                       ("avx2", "AVX2")):
        if flag in flags:
            return name
    return {"AVX512": "AVX512", "AVX2": "AVX2"}.get(torch.backends.cpu.get_cpu_capability(), "no SIMD extension")


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def sources(source: Path) -> list[Path]:
    """`source` and every file it #includes with quotes, recursively: what its build is keyed by."""
    found, queue = [], [source]
    while queue:
        path = queue.pop(0)
        if path not in found:
            found.append(path)
            queue += [path.parent / name for name in _INCLUDE.findall(path.read_text())]
    return found


def build(source: Path, extra_flags: tuple[str, ...] = ()) -> tuple[ctypes.CDLL, str]:
    """Compile `source` for this CPU (or reuse the cached build) and load it: (library, target name).
    `extra_flags`: the extensions it needs beyond the CPU's vector ISA (e.g. AMX). Raises BuildError
    with the reason when there is no compiler or the build fails."""
    compiler = find_c_compiler()
    if compiler is None:
        raise BuildError("no C compiler")
    target, flags = cpu_target()
    command = [compiler, "-O3", "-shared", "-fPIC", *flags, *extra_flags]
    try:
        texts = [path.read_text() for path in sources(source)]
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


class Loader:
    """One kernel, built at its first use: calling it gives `bind(library, target)`, the library's entry
    points declared for ctypes, or None when it cannot be built here; `why_not()` says why (None when
    it was built). `bind` may itself return a reason (a string) instead. `extra_flags`: the flags the
    build adds for this CPU, or a function of the CPU giving them or the reason there is no build.
    `cache_clear()` forgets the kernel, as tests do to build again."""

    def __init__(self, source: Path, bind: Callable, extra_flags: tuple[str, ...] | Callable = ()):
        self.source, self._bind, self._extra_flags = source, bind, extra_flags
        self._load = functools.cache(self._build)

    def _build(self):
        flags = self._extra_flags() if callable(self._extra_flags) else self._extra_flags
        if isinstance(flags, str):
            return flags
        try:
            library, target = build(self.source, flags)
        except BuildError as error:
            return str(error)
        return self._bind(library, target)

    def __call__(self):
        loaded = self._load()
        return None if isinstance(loaded, str) else loaded

    def why_not(self) -> str | None:
        loaded = self._load()
        return loaded if isinstance(loaded, str) else None

    def cache_clear(self) -> None:
        self._load.cache_clear()

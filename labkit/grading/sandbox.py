"""Containment for a student's kernel: what it may touch, how long and how much, and its end.

Three layers, the strongest the machine offers:
- bubblewrap (`bwrap`), when installed and usable: the whole filesystem read-only, a fresh /tmp,
  only the student's temporary folder writable, the solutions, the class's folder and the report's
  folder hidden, no network, its own process namespace (everything in it dies with it).
- otherwise, when grading as root: the kernel runs as a uid of its own (not in /etc/passwd, owns
  only the temporary folder, so the course checkout and the report are not writable to it), and
  after grading every process of that uid is killed, detached ones included.
- always: rlimits (address space, file size, no core dumps, processes), a new session whose
  process group is killed, a fresh HOME and a minimal environment.
Without root or bubblewrap, student code can write wherever the instructor can and a process
that detaches itself can outlive grading: grade untrusted work in a container or VM (README).
"""

import functools
import os
import pwd
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from labkit.grading.integrity import COURSE_ROOT

FIRST_UID = 64100  # uids FIRST_UID.. are handed to kernels, one per concurrent kernel
KEPT_ENV = ("PATH", "LANG", "LC_ALL", "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM", "CUDA_VISIBLE_DEVICES")


@dataclass(frozen=True)
class Limits:
    cell_s: float = 300.0  # one cell of the student's notebook
    notebook_s: float = 900.0  # all cells of one notebook together
    call_s: float = 120.0  # one call of a student's function by a grader
    memory_bytes: int | None = 8 * 2**30  # address space of each process (None: no limit)
    output_bytes: int = 2 * 2**20  # outputs kept per notebook; the rest is dropped
    file_bytes: int = 256 * 2**20  # largest file the kernel may write
    notebook_bytes: int = 32 * 2**20  # largest notebook accepted for grading
    processes: int = 256  # processes per kernel uid (uid mode only)


@functools.cache
def bwrap_usable() -> bool:
    """bubblewrap is installed and this machine lets it build a sandbox (containers may not)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return False
    probe = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-all",
             "--die-with-parent", "--new-session", "true"]
    try:
        return subprocess.run(probe, capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@functools.cache
def uid_usable() -> bool:
    """Running as root, and a uid of no account can run this Python and import labkit."""
    if os.geteuid() != 0:
        return False
    try:
        probe = subprocess.run([sys.executable, "-c", "import labkit"], user=FIRST_UID, group=FIRST_UID,
                               extra_groups=[], env={}, cwd="/", capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return probe.returncode == 0


def mode() -> str:
    """"bwrap", "uid" (root without bubblewrap) or "plain" (neither: only limits and a process group)."""
    if bwrap_usable():
        return "bwrap"
    return "uid" if uid_usable() else "plain"


def kernel_env(workdir: Path) -> dict[str, str]:
    """A minimal environment (no instructor's secrets); labkit is imported from the grader's own copy."""
    env = {key: os.environ[key] for key in KEPT_ENV if key in os.environ}
    env.update(HOME=str(workdir), TMPDIR=str(workdir / "tmp"), HF_HUB_OFFLINE="1", PYTHONPATH=str(COURSE_ROOT),
               PYDEVD_DISABLE_FILE_VALIDATION="1", MPLBACKEND="agg", PYTHONDONTWRITEBYTECODE="1")
    return env


def wrap_command(argv: list[str], workdir: Path, hidden: list[Path], limits: Limits, uid: int | None) -> list[str]:
    """The kernel's command line inside the sandbox, behind `python -m labkit.grading.sandbox`."""
    confine = [sys.executable, "-m", "labkit.grading.sandbox", "--processes", str(limits.processes),
               "--file-bytes", str(limits.file_bytes)]
    if limits.memory_bytes:
        confine += ["--memory-bytes", str(limits.memory_bytes)]
    if uid is not None:
        confine += ["--uid", str(uid)]
    confine += ["--", *argv]
    if mode() != "bwrap":
        return confine
    confine.insert(3, "--in-pid-namespace")
    command = [shutil.which("bwrap"), "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
               "--tmpfs", "/tmp", "--tmpfs", "/dev/shm"]
    for path in _needed_under_scratch():  # a course cloned into /tmp must not vanish under the fresh /tmp
        command += ["--ro-bind", str(path), str(path)]
    for path in hidden:  # mounted over after the root bind, before the workdir is bound back
        if path.is_dir() and not workdir.is_relative_to(path):
            command += ["--tmpfs", str(path)]
    command += ["--bind", str(workdir), str(workdir), "--unshare-all", "--die-with-parent", "--new-session",
                "--chdir", str(workdir), "--"]
    return command + confine


def _needed_under_scratch() -> list[Path]:
    """The course, its Python and its packages, where they sit under /tmp or /dev/shm (which the
    sandbox replaces with empty folders): bound back read-only, outermost first."""
    needed = {COURSE_ROOT, Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve(),
              Path(sys.executable).resolve().parent}
    scratch = [Path("/tmp"), Path("/dev/shm")]
    inside = sorted(p for p in needed if any(p.is_relative_to(s) and p != s for s in scratch))
    return [p for p in inside if not any(p != q and p.is_relative_to(q) for q in inside)]


def prepare_workdir(workdir: Path, uid: int | None) -> None:
    (workdir / "tmp").mkdir(exist_ok=True)
    if uid is not None:
        for path in [workdir, *workdir.rglob("*")]:
            os.chown(path, uid, uid, follow_symlinks=False)


class UidPool:
    """Hands out uids nobody else uses, one per concurrent kernel (uid mode)."""

    def __init__(self):
        self._lock, self._free = threading.Lock(), []
        self._next = FIRST_UID

    def take(self) -> int:
        with self._lock:
            if self._free:
                return self._free.pop()
            while True:
                uid, self._next = self._next, self._next + 1
                try:
                    pwd.getpwuid(uid)
                except KeyError:
                    if not processes_of_uid(uid):
                        return uid

    def give_back(self, uid: int) -> None:
        with self._lock:
            self._free.append(uid)


def processes_of_uid(uid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def descendants(pid: int) -> set[int]:
    """Every live process under `pid` (by parent links), `pid` included."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        current = todo.pop()
        if current not in found:
            found.add(current)
            todo += children.get(current, [])
    return found


def _pid_namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def kill_everything(leader_pid: int, uid: int | None) -> list[int]:
    """Kill the kernel, its process group and all it spawned; returns the pids that survived."""
    tree = descendants(leader_pid)
    namespaces = {_pid_namespace(p) for p in tree} - {_pid_namespace(os.getpid()), None}
    for _ in range(20):
        for pid in tree:
            for kill in (os.killpg, os.kill):
                try:
                    kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        if uid is not None:  # kill(-1) as that uid reaches every process it owns, detached or not
            subprocess.run([shutil.which("kill") or "/bin/kill", "-KILL", "-1"], user=uid, group=uid,
                           extra_groups=[], env={}, check=False, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
        time.sleep(0.05)
        survivors = list(descendants(leader_pid))
        if uid is not None:
            survivors += processes_of_uid(uid)
        if namespaces:
            survivors += [p for p in _all_pids() if _pid_namespace(p) in namespaces]
        survivors = [p for p in survivors if _alive(p)]  # a zombie is dead, only not reaped yet
        if not survivors:
            return []
        tree = set(survivors)
    return sorted(set(survivors))


def _all_pids() -> list[int]:
    return [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def refusal(path: Path, limits: Limits) -> str | None:
    """Why a student's file is not graded, or None if it may be."""
    if path.is_symlink():
        return "refused: it is a symbolic link (hand in the notebook itself)"
    if not path.is_file():
        return "refused: not a regular file"
    size = path.stat().st_size
    if size > limits.notebook_bytes:
        return f"refused: {size / 2**20:.1f} MiB is over the limit of {limits.notebook_bytes / 2**20:.0f} MiB"
    return None


def _confine(argv: list[str]) -> None:
    """Entry point inside the sandbox: limits, then (as root) drop to the kernel's uid, then exec."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m labkit.grading.sandbox")
    parser.add_argument("--uid", type=int)
    parser.add_argument("--memory-bytes", type=int)
    parser.add_argument("--file-bytes", type=int, required=True)
    parser.add_argument("--processes", type=int, required=True)
    parser.add_argument("--in-pid-namespace", action="store_true",
                        help="the parent's pid means nothing here: the kernel must not poll it")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.memory_bytes:
        resource.setrlimit(resource.RLIMIT_AS, (args.memory_bytes, args.memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (args.file_bytes, args.file_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if args.uid is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (args.processes, args.processes))
        os.setgroups([])
        os.setgid(args.uid)
        os.setuid(args.uid)
    env = dict(os.environ)
    if args.in_pid_namespace:
        env["JPY_PARENT_PID"] = "1"  # ipykernel: no parent to poll, and no connection banner
    os.execvpe(command[0], command, env)


if __name__ == "__main__":
    _confine(sys.argv[1:])

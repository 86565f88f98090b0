"""Containment for a student's kernel: what it may see, touch and use, for how long, and its end.

Grading runs a student's kernel in bubblewrap (`bwrap`), or refuses to grade, unless the instructor
names the alternative (`--no-sandbox`). In the sandbox the kernel
- runs with no capabilities and no way to gain them: as root, bubblewrap starts it as root and
  `confine.py` drops it to a uid of its own (one per kernel, in no account), its bounding set
  emptied and no_new_privs set; as a normal user, in a user namespace whose capabilities bubblewrap
  drops, with further user namespaces disabled;
- sees a filesystem made for it: the system's programs and libraries, this Python, its packages,
  labkit and the course's package, read-only, with the graders (`labkit_course/grading/labs`) hidden;
  a HOME and /tmp of its own on size-limited tmpfs; the folder of its Jupyter channels. Not the
  checkout (.git, solutions/, notebooks/, reports), not the class's folders, not /root or /home, not
  /etc beyond what loading a program needs;
- has no network, its own process, IPC and host-name namespaces, a new session, and dies with the
  process that grades it;
- is limited in address space per process, file size, core dumps and (with a uid of its own)
  processes.
Without the sandbox only the limits, the new session and the kill at the end apply, and student
code runs with the instructor's privileges: `mode()` and the report say which it was.
"""

import fcntl
import functools
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from labkit_course.grading.integrity import COURSE_ROOT

FIRST_UID = 64100  # as root, uids FIRST_UID.. are handed to kernels, one per concurrent kernel
KEPT_ENV = ("PATH", "LANG", "LC_ALL", "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM", "CUDA_VISIBLE_DEVICES")
CONFINE = Path(__file__).with_name("confine.py")
# The checkout's folders a kernel reads (never the whole checkout): the engine and the course's package,
# imported from the folders on its PYTHONPATH, and the course's data; the graders and the knowledge
# checks' keys are hidden.
KERNEL_READS = (Path("labkit"), Path("course", "labkit_course"), Path("datasets"))
IMPORT_ROOTS = (Path("."), Path("course"))
GRADERS = Path("course", "labkit_course", "grading", "labs")
ETC_NEEDED = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "nsswitch.conf", "localtime")


class SandboxUnavailable(RuntimeError):
    """Grading would run students' code without the containment it promises."""


@dataclass(frozen=True)
class Limits:
    cell_s: float = 300.0  # one cell of the student's notebook
    notebook_s: float = 900.0  # all cells of one notebook together, and again all graders' calls together
    call_s: float = 120.0  # one call of a student's function by a grader
    interrupt_s: float = 5.0  # for the kernel to answer, once a call past its time is interrupted
    memory_bytes: int | None = 8 * 2**30  # address space of each process (None: no limit)
    file_bytes: int = 256 * 2**20  # largest file the kernel may write
    notebook_bytes: int = 32 * 2**20  # largest notebook accepted for grading
    processes: int = 256  # processes and threads of a kernel's own uid (as root)
    tmpfs_bytes: int = 512 * 2**20  # each of the kernel's HOME, /tmp and /dev/shm (in the sandbox)
    reply_bytes: int = 64 * 2**20  # one reply of the grading agent
    message_bytes: int = 8 * 2**20  # one message on the kernel's Jupyter channels
    channel_bytes: int = 2**20  # what the kernel may leave in its channel folder besides its sockets
    startup_s: float = 60.0  # starting and stopping a notebook's kernels, reading and checking it

    @property
    def hard_s(self) -> float:
        """Wall-clock limit for one notebook, everything included: its cells (a replay shares their
        budget), the graders' calls (a budget of their own), starting and stopping its kernels."""
        return 2 * self.notebook_s + self.startup_s


def mode(no_sandbox: bool = False) -> str:
    """"bwrap" when bubblewrap contains kernels here, "none" when asked for no sandbox; otherwise
    SandboxUnavailable, which says what to install or which option runs without it."""
    if no_sandbox:
        return "none"
    problem = install_problem()
    if problem:
        raise SandboxUnavailable(problem)
    problem = bwrap_problem()
    if problem is None:
        return "bwrap"
    fix = ("install it (apt-get install bubblewrap)" if shutil.which("bwrap") is None else
           "let it create namespaces (in Docker: --security-opt seccomp=unconfined --security-opt "
           "apparmor=unconfined, or --privileged; on Ubuntu 24.04 as a normal user: sysctl "
           "kernel.apparmor_restrict_unprivileged_userns=0, or an AppArmor profile for bwrap)")
    raise SandboxUnavailable(
        f"grading contains each student's kernel with bubblewrap, but {problem}: {fix}. Or, for notebooks "
        "you trust, grade with --no-sandbox (with make: GRADE_ARGS=--no-sandbox): their code then runs with "
        "your privileges, can read and write whatever you can, use the network and see the other students' "
        "folders")


def install_problem() -> str | None:
    """None when labkit_course is imported from the checkout that grades (COURSE_ROOT/course); otherwise
    why that matters. Installed anywhere else it lies in the Python environment, which every kernel
    can read (the sandbox binds it): its graders and the quizzes' keys with it."""
    import labkit_course

    package = Path(labkit_course.__file__).resolve().parent
    checkout = COURSE_ROOT / "course"
    if package.is_relative_to(checkout):
        return None
    # labkit itself may be installed (not editable) too: then there is no checkout to name
    where = f"the checkout at {checkout}" if (checkout / "pyproject.toml").is_file() else "a checkout"
    return (f"the course package is imported from {package}, not from {where}: "
            "installed like that (pip install without -e), its graders and the knowledge checks' keys sit in the "
            "Python environment, which every student's kernel can read. Install both packages from the checkout, "
            "editable: make setup, or pip install -e . -e course")


@functools.cache
def bwrap_problem() -> str | None:
    """None when bubblewrap runs a contained Python that imports the grading agent here; otherwise
    why not, in a few words. The probe is the real command line, with a private uid as root."""
    if shutil.which("bwrap") is None:
        return "bubblewrap (bwrap) is not installed"
    uid = UIDS.take() if is_root() else None
    workdir = Workdir.create(uid)
    try:
        command = wrap_command([sys.executable, "-c", "import labkit_course.grading.agent"], workdir, Limits(), uid,
                               "bwrap")
        probe = subprocess.run(command, capture_output=True, text=True, timeout=120,
                               env=kernel_env(workdir), cwd=workdir.root)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"bwrap could not run here ({error})"
    finally:
        workdir.remove()
        if uid is not None:
            UIDS.give_back(uid)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or [f"exit status {probe.returncode}"])[-1]
        return f"bwrap fails here ({last[:300]})"
    return None


@dataclass(frozen=True)
class Workdir:
    """One kernel's folders: `root` is the grader's, of which the kernel sees only `home`, its working
    folder and HOME (a size-limited tmpfs in the sandbox), and `channel`, its connection file and
    sockets; `etc` holds the few files the sandbox's /etc gets."""

    root: Path

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def channel(self) -> Path:
        return self.root / "channel"

    @property
    def etc(self) -> Path:
        return self.root / "etc"

    @classmethod
    def create(cls, uid: int | None, parent: Path | None = None) -> "Workdir":
        """A fresh workdir, in `parent` (a run's scratch folder, removed by the run) or the temp folder."""
        workdir = cls(Path(tempfile.mkdtemp(prefix="kernel-", dir=parent)))
        workdir.root.chmod(0o711)  # a kernel's uid may pass through to its folders, not list the rest
        for folder in (workdir.home, workdir.home / "tmp", workdir.channel, workdir.etc):
            folder.mkdir()
        owner = uid if uid is not None else os.getuid()
        (workdir.etc / "passwd").write_text(f"student:x:{owner}:{owner}:student:{workdir.home}:/bin/sh\n")
        (workdir.etc / "group").write_text(f"student:x:{owner}:\n")
        (workdir.etc / "hosts").write_text("127.0.0.1 localhost\n::1 localhost\n")
        if uid is not None:
            for path in (workdir.home, workdir.home / "tmp", workdir.channel):
                os.chown(path, uid, uid)
        return workdir

    def lock_channel(self, uid: int | None) -> None:
        """After the kernel has made its sockets: its uid may no longer add files to the channel."""
        if uid is not None:
            os.chown(self.channel, os.getuid(), os.getgid())
            self.channel.chmod(0o711)

    def unlock_channel(self, uid: int | None) -> None:
        if uid is not None:
            os.chown(self.channel, uid, uid)

    def channel_overflow(self, limit: int) -> str | None:
        """Why the channel folder holds more than the kernel's sockets and connection file, if it does
        (a kernel of the instructor's own uid can write there)."""
        total, count = 0, 0
        for folder, subfolders, files in os.walk(self.channel):
            count += len(subfolders) + len(files)
            if count > 64:
                return "it made too many files in its channel folder"
            for name in files:
                try:
                    total += os.lstat(os.path.join(folder, name)).st_size
                except OSError:
                    continue
        return f"it wrote {total} bytes into its channel folder" if total > limit else None

    def remove(self) -> None:
        remove_tree(self.root)


def remove_tree(path: Path) -> None:
    """Remove a folder a kernel wrote in (its processes all dead), even where it took away its own
    permissions (chmod 000); a symbolic link is removed, never followed."""
    for folder, subfolders, _ in os.walk(path):  # top-down: each folder is opened before it is entered
        for name in subfolders:
            child = os.path.join(folder, name)
            if not os.path.islink(child):
                try:
                    os.chmod(child, 0o700)
                except OSError:
                    continue
    shutil.rmtree(path, ignore_errors=True)


def kernel_env(workdir: Workdir) -> dict[str, str]:
    """A minimal environment (no instructor's secrets); labkit and labkit_course are imported from the
    grader's own checkout."""
    env = {key: os.environ[key] for key in KEPT_ENV if key in os.environ}
    env.update(HOME=str(workdir.home), TMPDIR=str(workdir.home / "tmp"), HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(str(COURSE_ROOT / p) for p in IMPORT_ROOTS),
               PYDEVD_DISABLE_FILE_VALIDATION="1", MPLBACKEND="agg",
               PYTHONDONTWRITEBYTECODE="1", LABKIT_GRADED="1")
    return env


def wrap_command(argv: list[str], workdir: Workdir, limits: Limits, uid: int | None, how: str) -> list[str]:
    """The kernel's command line: `confine.py` (limits, then the uid), inside bubblewrap unless `how`
    is "none"."""
    confine = [sys.executable, "-I", "-S", str(CONFINE), "--file-bytes", str(limits.file_bytes)]
    if limits.memory_bytes:
        confine += ["--memory-bytes", str(limits.memory_bytes)]
    if uid is not None:
        confine += ["--uid", str(uid), "--processes", str(limits.processes)]
    confine += ["--", *argv]
    if how == "none":
        return confine
    command = [shutil.which("bwrap"), "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
               "--unshare-cgroup-try", "--die-with-parent", "--new-session"]
    if not is_root():  # bubblewrap maps us into a user namespace and drops its capabilities
        command += ["--unshare-user", "--disable-userns"]
    size = str(limits.tmpfs_bytes)
    command += _system_mounts(workdir) + ["--perms", "01777", "--size", size, "--tmpfs", "/tmp",
                                          "--perms", "01777", "--size", size, "--tmpfs", "/dev/shm"]
    made: set[Path] = set()  # mounted in order: what lies under /tmp goes on the fresh /tmp
    for path in _readable_trees():
        command += _parents(path, made) + ["--ro-bind", str(path), str(path)]
    graders = str(COURSE_ROOT / GRADERS)  # hidden (the graders, the quizzes' keys), and read-only: not a
    command += ["--perms", "0555", "--tmpfs", graders, "--remount-ro", graders]  # disk to fill as its owner
    command += _parents(workdir.home, made) + [
        "--perms", "01777", "--size", size, "--tmpfs", str(workdir.home),
        "--perms", "01777", "--dir", str(workdir.home / "tmp"),
        "--bind", str(workdir.channel), str(workdir.channel),
        "--chdir", str(workdir.home),
        "--setenv", "JPY_PARENT_PID", "1",  # ipykernel: the grader's pid means nothing here; don't poll it
        "--"]
    return command + confine


def _system_mounts(workdir: Workdir) -> list[str]:
    """/usr and its merged-/usr links, a few of /etc, fresh /proc and /dev."""
    mounts = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        top = Path("/") / name
        if top.is_symlink():
            mounts += ["--symlink", os.readlink(top), str(top)]
        elif top.is_dir():
            mounts += ["--ro-bind", str(top), str(top)]
    mounts += ["--perms", "0755", "--dir", "/etc"]
    for name in ETC_NEEDED:
        if (Path("/etc") / name).exists():
            mounts += ["--ro-bind", f"/etc/{name}", f"/etc/{name}"]
    for name in ("passwd", "group", "hosts"):
        mounts += ["--ro-bind", str(workdir.etc / name), f"/etc/{name}"]
    return mounts + ["--proc", "/proc", "--dev", "/dev"]


def _readable_trees() -> list[Path]:
    """What a kernel reads besides the system: this Python, its packages and the checkout's two packages,
    outermost first (the checkout is never bound whole: only its packages and its environment)."""
    needed = {Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve(), Path(sys.executable).resolve().parent,
              *(COURSE_ROOT / p for p in KERNEL_READS)}
    needed = {p for p in needed if not p.is_relative_to("/usr")}
    ordered = sorted(needed, key=lambda p: len(p.parts))
    return [p for i, p in enumerate(ordered) if not any(p.is_relative_to(q) for q in ordered[:i])]


def _parents(path: Path, made: set[Path]) -> list[str]:
    """Directories leading to `path`, created traversable (bubblewrap would make them 0700)."""
    args = []
    for parent in reversed(path.parents):
        if parent != Path("/") and parent not in made and not parent.is_relative_to("/usr"):
            made.add(parent)
            args += ["--perms", "0755", "--dir", str(parent)]
    return args


class UidPool:
    """Hands out uids nobody else uses (as root): one per running kernel, across every grading process on
    the machine (each uid in use is a lock held on a file, which the kernel releases if its holder dies)."""

    def __init__(self):
        run = Path("/run") if Path("/run").is_dir() else Path(tempfile.gettempdir())
        self.folder, self._lock, self._held = run / "labkit-kernel-uids", threading.Lock(), {}

    def take(self) -> int:
        self.folder.mkdir(mode=0o700, exist_ok=True)
        with self._lock:
            for uid in range(FIRST_UID, FIRST_UID + 10_000):
                if uid in self._held or _has_account(uid):
                    continue
                lock = open(self.folder / f"{uid}.lock", "w")  # noqa: SIM115 - held until give_back
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    lock.close()
                    continue
                if processes_of_uid(uid):  # left by something else: not ours to reuse
                    lock.close()
                    continue
                self._held[uid] = lock
                return uid
        raise RuntimeError(f"no free uid for a kernel in {FIRST_UID}..{FIRST_UID + 9_999}")

    def give_back(self, uid: int) -> None:
        with self._lock:
            self._held.pop(uid).close()


def _has_account(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


UIDS = UidPool()


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


def descendants(pid: int, spare: Collection[int] = ()) -> set[int]:
    """Every live process under `pid` (by parent links), `pid` included, but those in `spare` and under
    them. One reading of /proc answers both: read twice, a process born in between (a kernel starting
    under a spared worker) would look like no one's and be taken."""
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
        if current not in found and current not in spare:
            found.add(current)
            todo += children.get(current, [])
    return found


def become_subreaper() -> None:
    """Orphans of this process's descendants come back to it instead of to init, so that
    `kill_descendants` finds a double-forked process too."""
    import ctypes

    PR_SET_CHILD_SUBREAPER = 36
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def kill_tree(leader: int | None, uid: int | None = None) -> list[int]:
    """Kill `leader` (if any), everything under it and every process of `uid`; returns the pids that survived."""
    return _kill_until_gone(lambda: (descendants(leader) if leader is not None else set()) |
                            set(processes_of_uid(uid) if uid is not None else []))


def kill_descendants(spare: set[int] = frozenset()) -> list[int]:
    """Kill every process under this one (orphans included, for a subreaper) but those in `spare` and
    under them; returns the pids that survived."""
    me = os.getpid()
    return _kill_until_gone(lambda: descendants(me, spare) - {me})


def _kill_until_gone(find) -> list[int]:
    for _ in range(40):
        targets = {p for p in find() if _alive(p)}
        if not targets:
            _reap_zombies()
            return []
        for pid in targets:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.05)
        _reap_zombies()
    return sorted(targets)


def _reap_zombies() -> None:
    """Collect our own children that have died (a subreaper inherits the orphans it must reap)."""
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state, ppid = Path(entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue
        if state == "Z" and int(ppid) == me:
            try:
                os.waitpid(int(entry.name), os.WNOHANG)
            except ChildProcessError:
                pass


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def is_root() -> bool:
    return os.geteuid() == 0


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

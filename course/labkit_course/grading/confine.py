"""The last step before a student's kernel runs: its limits set and its privileges dropped for good.

Run as `python -I -S confine.py [options] -- command...` (isolated, no site packages: nothing of the
student's or the venv's runs before the privileges are gone), inside the sandbox or, with
`--no-sandbox`, directly. It sets the resource limits, asks the kernel to kill this process when its
parent (the grader) dies, and, given `--uid`, drops from root to that uid for good: the capability
bounding set emptied, every uid and gid set, no supplementary groups, and no_new_privs so that no
set-uid program or file capability can give anything back. Then it execs the command.
Standard library only: it runs before anything else is trusted to import.
"""

import argparse
import ctypes
import os
import resource
import signal
import sys

PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38


def _prctl(libc, option: int, value: int) -> None:
    if libc.prctl(option, value, 0, 0, 0) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"prctl({option}, {value}): {os.strerror(error)}")


def _drop_to(libc, uid: int) -> None:
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last_cap = int(f.read())
    for cap in range(last_cap + 1):
        _prctl(libc, PR_CAPBSET_DROP, cap)
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)  # from root to another uid: the permitted and effective capabilities go too
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
    if any(int(status[key], 16) for key in ("CapPrm", "CapEff", "CapBnd", "CapAmb")):
        raise OSError("capabilities remain after dropping to the kernel's uid")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="confine.py")
    parser.add_argument("--uid", type=int, help="as root: the uid to run as (a private one per kernel)")
    parser.add_argument("--memory-bytes", type=int, help="address space of each process")
    parser.add_argument("--file-bytes", type=int, required=True, help="largest file it may write")
    parser.add_argument("--processes", type=int, help="processes and threads of its uid (with --uid: a private one)")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    libc = ctypes.CDLL(None, use_errno=True)
    if args.memory_bytes:
        resource.setrlimit(resource.RLIMIT_AS, (args.memory_bytes, args.memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (args.file_bytes, args.file_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if args.processes:
        resource.setrlimit(resource.RLIMIT_NPROC, (args.processes, args.processes))
    if args.uid is not None:
        _drop_to(libc, args.uid)
    _prctl(libc, PR_SET_NO_NEW_PRIVS, 1)
    _prctl(libc, PR_SET_PDEATHSIG, signal.SIGKILL)  # after the uid change, which would clear it
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])

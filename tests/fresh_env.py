"""A fresh virtualenv that already has this environment's libraries (torch, transformers, ...) but not
labkit: what a student's machine or a Colab runtime looks like, built offline in seconds.

The new environment has no packages of its own; a .pth file puts this environment's site-packages
after its own, so `pip install` there (of labkit only, --no-deps --no-index) resolves every
dependency to what is already installed and downloads nothing. Paths added by a .pth file do not
run that folder's own .pth files, so this checkout's editable labkit stays invisible.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def fresh_venv(path: Path) -> Path:
    """Create the environment; return its bin/ folder (python, and a `pip` that runs its python's pip)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    bin_dir = path / "bin"
    site = subprocess.run([bin_dir / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "preinstalled.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = bin_dir / "pip"
    pip.write_text(f'#!/bin/sh\nexec "{bin_dir / "python"}" -m pip "$@"\n')
    pip.chmod(0o755)
    return bin_dir


def offline_env(bin_dir: Path, **extra) -> dict[str, str]:
    """Environment variables for running in the fresh environment: its bin/ first, pip offline, builds
    with the setuptools already installed (no isolated build environment to download)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", PIP_NO_INDEX="1", PIP_NO_BUILD_ISOLATION="0",
               PIP_DISABLE_PIP_VERSION_CHECK="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", **extra)
    return env


def copy_checkout(target: Path) -> Path:
    """This checkout's files as git sees them (tracked and new, not ignored), in `target`."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    return target

"""`labkit serve` and `labkit loadgen` without the `serve` extra say in one line what to install, and
exit non-zero; any other missing module still raises with its traceback."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from labkit.__main__ import SERVE_EXTRA

ROOT = Path(__file__).resolve().parent.parent


def run_without(module: str, *argv: str) -> subprocess.CompletedProcess:
    """`labkit argv...` in a fresh interpreter where importing `module` fails as if it were not installed."""
    code = ("import sys\n"
            "class Missing:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            f"        if name.split('.')[0] == {module!r}:\n"
            "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
            "sys.meta_path.insert(0, Missing())\n"
            "from labkit.__main__ import main\n"
            f"main({list(argv)!r})\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("module", "command"), [("uvicorn", "serve"), ("httpx", "loadgen")])
def test_a_missing_serve_extra_is_one_line_naming_the_package_and_the_install(module, command):
    result = run_without(module, command, "--help")
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        f"labkit {command}: needs the package '{module}' of the serve extra; "
        "install it with: pip install 'labkit[serve]'"]


def test_another_missing_module_keeps_its_traceback():
    result = run_without("torch", "serve", "--help")
    assert result.returncode != 0
    assert "Traceback" in result.stderr and "No module named 'torch'" in result.stderr
    assert "labkit[serve]" not in result.stderr


def test_the_modules_named_are_the_serve_extra_of_pyproject():
    extra = re.search(r"^serve = \[(.*?)^\]", (ROOT / "pyproject.toml").read_text(), re.S | re.M).group(1)
    assert {name.replace("-", "_") for name in re.findall(r'^\s*"([\w.-]+)', extra, re.M)} == SERVE_EXTRA

"""The course's package builds no sdist, loudly: its data come from the repository's datasets/, outside
course/, so an sdist of course/ could not make a wheel that carries them. The wheel from a checkout does
(test_install.py). The hook runs as a PEP 517 frontend runs it, with pip's own copies of pyproject_hooks
and tomli, from what course/pyproject.toml declares."""

import ast
import importlib.metadata
import re
import sys

import pytest
from fresh_env import ROOT
from pip._vendor import tomli
from pip._vendor.pyproject_hooks import BuildBackendHookCaller

COURSE = ROOT / "course"


def test_building_an_sdist_of_the_course_is_refused_with_what_to_build_instead(tmp_path, capfd):
    build_system = tomli.loads((COURSE / "pyproject.toml").read_text())["build-system"]
    hooks = BuildBackendHookCaller(str(COURSE), build_system["build-backend"], build_system.get("backend-path"))
    with pytest.raises(Exception, match="build_sdist"):  # the frontend's error: the hook's process failed
        hooks.build_sdist(str(tmp_path))
    assert not list(tmp_path.iterdir())
    err = capfd.readouterr().err
    assert "labkit-course builds no sdist" in err and "pip wheel --no-deps course/" in err


def _distribution(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_every_package_the_course_imports_is_declared():
    """What course/labkit_course imports comes from the standard library, labkit, or a distribution
    that the course's or labkit's pyproject.toml declares (the cluster extra's for Dask)."""
    course = tomli.loads((COURSE / "pyproject.toml").read_text())["project"]
    engine = tomli.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {_distribution(r) for r in course["dependencies"] + engine["dependencies"]
                + [r for extra in course["optional-dependencies"].values() for r in extra]}
    imported = set()
    for path in (COURSE / "labkit_course").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                imported.add(node.module.split(".")[0])
    third_party = imported - set(sys.stdlib_module_names) - {"labkit", "labkit_course"}
    providers = importlib.metadata.packages_distributions()
    missing = {module: providers.get(module) for module in third_party
               if not {_distribution(d) for d in providers.get(module, [])} & declared}
    assert not missing, f"imported by the course but declared nowhere: {missing}"

"""The course's package builds no sdist, loudly: its data come from the repository's datasets/, outside
course/, so an sdist of course/ could not make a wheel that carries them. The wheel from a checkout does
(test_install.py). The hook runs as a PEP 517 frontend runs it, with pip's own copies of pyproject_hooks
and tomli, from what course/pyproject.toml declares."""

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

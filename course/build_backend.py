"""The course's build backend: setuptools', except that it refuses to build an sdist.

The course's data live at the top of the repository (datasets/, beside course/), and the wheel takes
them from there (package-dir in pyproject.toml). An sdist holds course/ alone, so a wheel built from
it would lack them, or fail. Every way the course installs (make setup, Colab, Gradescope) builds from
the checkout, so the one supported build is a wheel (or an editable install) from this folder.
"""

from setuptools.build_meta import *  # noqa: F403 - every other hook is setuptools' own


def build_sdist(sdist_directory, config_settings=None):
    raise SystemExit("labkit-course builds no sdist: its data come from the repository's datasets/, outside "
                     "course/. Build the wheel from a checkout instead: pip wheel --no-deps course/ "
                     "(or python -m build --wheel course/)")

"""Where the course lives: the one repository address behind the "Open in Colab" badges, the README's
badges and the Colab setup cell that starts every lab. Change it here (a fork, a mirror), then run
`python -m labkit_course.grading notebooks`; the tests name every other place that must follow.
"""

REPOSITORY = "https://github.com/inside-llm-inference/course"
BRANCH = "main"
COLAB_BADGE_IMAGE = "https://colab.research.google.com/assets/colab-badge.svg"

# The first code cell of every lab. On Colab it clones the course, runs .colab/setup.sh (which
# installs labkit and labkit_course and stamps .colab/.installed when, and only when, it finished),
# and puts both packages' folders on sys.path; a stamped runtime skips straight to that. Elsewhere it
# prints nothing.
COLAB_SETUP_CELL = '''\
# Colab only: clone the course, install labkit and the course's package (once per runtime). Elsewhere this
# cell does nothing.
import os
import subprocess
import sys
import time

if "google.colab" in sys.modules:
    course = os.environ.get("COURSE_DIR", "/content/course")
    if not os.path.isfile(f"{course}/.colab/.installed"):
        started, repo = time.time(), os.environ.get("COURSE_REPO", "{repository}")
        if not os.path.isdir(f"{course}/.git"):
            print(f"cloning {repo} into {course}…", flush=True)
            if subprocess.run(["git", "clone", "-q", "--depth", "1", repo, course]).returncode:
                raise RuntimeError(f"could not clone {repo}. If the course lives elsewhere (a fork, a mirror), "
                                   "run a cell with\\n    %env COURSE_REPO=https://github.com/<owner>/<repository>\\n"
                                   "then run this cell again.")
        subprocess.run(["bash", f"{course}/.colab/setup.sh"], check=True)
        print(f"done in {time.time() - started:.0f} s", flush=True)
    for folder in (course, f"{course}/course"):  # labkit, and the course's package labkit_course
        if folder not in sys.path:
            sys.path.insert(0, folder)'''


def colab_setup_cell() -> str:
    """The source of every lab's first code cell."""
    return COLAB_SETUP_CELL.replace("{repository}", REPOSITORY)


def colab_url(notebook: str) -> str:
    """Colab's address for a student notebook of the course, e.g. colab_url("05_real_model_kv_cache.ipynb")."""
    path = REPOSITORY.removeprefix("https://github.com/")
    return f"https://colab.research.google.com/github/{path}/blob/{BRANCH}/notebooks/{notebook}"


def colab_badge(notebook: str) -> str:
    """The markdown of an "Open in Colab" badge for a student notebook."""
    return f"[![Open In Colab]({COLAB_BADGE_IMAGE})]({colab_url(notebook)})"

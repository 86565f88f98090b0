"""The course's own grading check: solutions earn full marks, untouched student notebooks zero.

Both are graded exactly as a class is (`labkit_course.grading.report`: contained kernels, trusted graders).

It also checks the wiring: every grader has a check cell in its lab's notebook and every check
cell names a grader, so an exercise can't silently go ungraded.
"""

import re
from pathlib import Path

import nbformat

from labkit_course.grading import sandbox
from labkit_course.grading.core import exercises
from labkit_course.grading.report import Options, format_table, grade_students, lab_of

CHECK_CELL = re.compile(r"""^\s*check\(\s*["'](\d\d)["']\s*,\s*["'](\w+)["']""", re.MULTILINE)


def wiring_problems(solutions: Path) -> list[str]:
    problems = []
    registered = {(ex.lab, ex.name) for ex in exercises()}
    checked = set()
    labs_with_notebooks = set()
    for path in sorted(solutions.glob("*.ipynb")):
        lab = lab_of(path)
        if lab is None:
            continue
        labs_with_notebooks.add(lab)
        nb = nbformat.read(path, as_version=nbformat.NO_CONVERT)
        for cell in nb.cells:
            for found_lab, name in CHECK_CELL.findall(cell.source if cell.cell_type == "code" else ""):
                if found_lab != lab:
                    problems.append(f"{path.name}: check cell for lab {found_lab}/{name} in lab {lab}")
                checked.add((found_lab, name))
    for lab, name in sorted(registered - checked):
        where = "its notebook" if lab in labs_with_notebooks else "any notebook (none for that lab)"
        problems.append(f"grader {lab}/{name} has no check cell in {where}")
    for lab, name in sorted(checked - registered):
        problems.append(f"check cell {lab}/{name} has no grader")
    return problems


def selfcheck(solutions: Path, notebooks: Path, jobs: int = 2) -> bool:
    problems = wiring_problems(solutions)
    problem = sandbox.bwrap_problem()
    if problem:  # the course's own notebooks: trusted, so they may run unsandboxed, but say so
        print(f"grading self-check without the sandbox: {problem}")
    graded = grade_students([solutions, notebooks], Options(jobs, no_sandbox=problem is not None))
    solved = [r for r in graded if r.student == solutions.name]
    blank = [r for r in graded if r.student == notebooks.name]
    for report in solved:
        problems += [f"solutions/{report.notebook}: {o.name} earns {o.points}/{o.max_points}: {o.message}"
                     for o in report.outcomes if not o.passed]
    for report in blank:
        problems += [f"notebooks/{report.notebook}: {o.name} earns {o.points} points unsolved"
                     for o in report.outcomes if o.points]
    print("Student notebooks as handed out (every exercise must earn 0, with a reason):")
    print(format_table(blank))
    total = sum(r.max_points for r in solved)
    print(f"\ngrading self-check: solutions {sum(r.points for r in solved)}/{total}, "
          f"student notebooks {sum(r.points for r in blank)}/{total}, "
          f"{sum(len(r.outcomes) for r in solved)} exercises in {len(solved)} labs")
    blank_seconds = {r.lab: r.seconds for r in blank}
    print("seconds per notebook, solution/student: " + ", ".join(
        f"{r.lab} {r.seconds:.0f}/{blank_seconds.get(r.lab, 0):.0f}" for r in solved if r.notebook))
    for problem in problems:
        print(f"PROBLEM: {problem}")
    return not problems

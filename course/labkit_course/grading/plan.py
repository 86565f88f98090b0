"""Which cells grading skips: the course's demonstrations that no graded name depends on.

A lab's notebook interleaves exercises with demonstrations (a model generating text, a plot, a
timing); graders only call the student's definitions. So a worker runs every cell the student wrote
or changed, and of the course's own cells (those as handed out) only the ones that bind a name a
grader or another running cell reads: a slice over the names each cell reads and binds
(`labkit_course.grading.assign.names_used_and_defined`, which counts `x.attr = ...` as binding `x`). The
graded names are the lab's exercises and its knowledge check's `answers`. What is skipped is only
what the course wrote, so a student cannot hide code from grading this way.
"""

import nbformat

from labkit_course.grading.assign import names_used_and_defined
from labkit_course.grading.core import exercises
from labkit_course.grading.rules import as_handed_out, course_cells


def graded_names(lab: str) -> set[str]:
    """What the lab's graders read from a notebook: its exercises' names and the knowledge check's."""
    return {ex.name for ex in exercises(lab)} | {"answers"}


def skipped_cells(nb: nbformat.NotebookNode, handed_out: nbformat.NotebookNode | None, needed: set[str]) -> set[int]:
    """Indexes (into nb.cells) of the course's code cells that nothing graded depends on. A course cell
    runs if it binds a name that a cell which runs reads, before or after it: a student's function may
    call a helper the notebook defines further down, and every cell has run by the time graders call."""
    course = course_cells(handed_out)
    cells = {index: names_used_and_defined(cell.source) for index, cell in enumerate(nb.cells)
             if cell.cell_type == "code"}
    kept = {index for index in cells if as_handed_out(nb.cells[index].source) not in course}
    needed = set(needed).union(*(cells[index][0] for index in kept))
    while True:
        more = {index for index, (_, defined, imported) in cells.items()
                if index not in kept and (defined | imported) & needed}
        if not more:
            return set(cells) - kept
        kept |= more
        needed = needed.union(*(cells[index][0] for index in more))

"""Course tooling: python -m labkit_course.grading {notebooks,execute,grade,selfcheck} (see `make help`)."""

import argparse
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    # Grading writes no bytecode, nor do the processes it starts: a compiled file that changes while
    # it runs is then an attack (labkit_course.grading.integrity), never our own.
    sys.dont_write_bytecode = True
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
    from labkit_course.grading.sandbox import Limits

    parser = argparse.ArgumentParser(prog="python -m labkit_course.grading")
    commands = parser.add_subparsers(dest="command", required=True)
    nbs = commands.add_parser("notebooks", help="generate the student notebooks from the solutions")
    nbs.add_argument("--solutions", type=Path, default=Path("solutions"))
    nbs.add_argument("--out", type=Path, default=Path("notebooks"))
    nbs.add_argument("--check", action="store_true", help="only report notebooks that differ")
    run = commands.add_parser("execute", help="re-execute notebooks in place")
    run.add_argument("paths", type=Path, nargs="+")
    run.add_argument("--refresh", action="store_true",
                     help="also re-record outputs of # NBVAL_IGNORE_OUTPUT cells (timings)")
    grade = commands.add_parser("grade", help="grade one student's folder of notebooks, or a folder of students")
    grade.add_argument("folder", type=Path)
    grade.add_argument("--report", type=Path, default=Path("reports/grades.json"),
                       help="the JSON report (or a folder for it); two CSVs are written next to it: one row per "
                            "exercise, and the gradebook")
    grade.add_argument("--jobs", type=int, default=2)
    grade.add_argument("--dask", default="", metavar="ADDRESS",
                       help="grade on a Dask cluster: a scheduler's TLS address (tls://host:8786) or local:N for a "
                            "LocalCluster of N workers here")
    grade.add_argument("--labs", default="",
                       help="the labs to grade, e.g. 00,06 (those assigned so far); a missing one counts 0; "
                            "default: every lab the course grades")
    grade.add_argument("--cell-timeout", type=float, default=Limits.cell_s, help="seconds per cell")
    grade.add_argument("--notebook-timeout", type=float, default=Limits.notebook_s,
                       help="seconds for all cells of a notebook")
    grade.add_argument("--call-timeout", type=float, default=Limits.call_s,
                       help="seconds for one call of a student's function by a grader")
    grade.add_argument("--memory-gb", type=float, default=Limits.memory_bytes / 2**30,
                       help="address-space limit per kernel process (0: none)")
    grade.add_argument("--no-sandbox", action="store_true",
                       help="grade without bubblewrap: student code runs with your privileges, can read and write "
                            "whatever you can, use the network and see other students' folders (trusted notebooks "
                            "only)")
    zipped = commands.add_parser("gradescope-zip", help="build a Gradescope autograder zip for some labs")
    zipped.add_argument("--labs", required=True, help="the labs the assignment grades, e.g. 06")
    zipped.add_argument("--out", type=Path, default=Path("reports/gradescope/autograder.zip"))
    on_gradescope = commands.add_parser("gradescope-run", help="(in the autograder) grade a Gradescope submission")
    on_gradescope.add_argument("--root", type=Path, default=Path("/autograder"))
    on_gradescope.add_argument("--labs", required=True)
    self_check = commands.add_parser("selfcheck", help="solutions earn full marks, notebooks zero")
    self_check.add_argument("--solutions", type=Path, default=Path("solutions"))
    self_check.add_argument("--notebooks", type=Path, default=Path("notebooks"))
    self_check.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args(argv)

    if args.command == "notebooks":
        from labkit_course.grading.assign import MarkerError, generate

        try:
            differing = generate(args.solutions, args.out, check_only=args.check)
        except MarkerError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        if args.check and differing:
            print("notebooks/ differs from what `make notebooks` generates: "
                  + ", ".join(str(p) for p in differing), file=sys.stderr)
            return 1
        return 0
    if args.command == "execute":
        from labkit_course.grading.execute import execute_in_place

        for path in args.paths:
            print(f"executing {path}", flush=True)
            execute_in_place(path, refresh_machine_dependent=args.refresh)
        return 0
    if args.command == "grade":
        from labkit_course.grading.integrity import CourseTampered
        from labkit_course.grading.report import Options, format_table, grade_folder, summary, write_reports
        from labkit_course.grading.sandbox import SandboxUnavailable

        limits = Limits(cell_s=args.cell_timeout, notebook_s=args.notebook_timeout, call_s=args.call_timeout,
                        memory_bytes=int(args.memory_gb * 2**30) or None)
        options = Options(args.jobs, limits, args.no_sandbox, _labs(args.labs), progress=True, dask=args.dask)
        report = args.report.resolve()
        report = report / "grades.json" if report.is_dir() else report  # a folder: the reports go in it
        try:
            report.parent.mkdir(parents=True, exist_ok=True)  # a report that cannot be written fails now
            if not os.access(report.parent, os.W_OK):
                raise PermissionError(f"cannot write the report into {report.parent}")
            reports = grade_folder(args.folder, options)
        except (CourseTampered, OSError, SandboxUnavailable, ValueError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        print(format_table(reports))
        written = write_reports(reports, report)
        print("reports written to " + ", ".join(map(str, written)))
        print(summary(reports))
        return 0  # graded; whether everything passed is in the summary and the reports
    if args.command in ("gradescope-zip", "gradescope-run"):
        from labkit_course.grading import gradescope
        from labkit_course.grading.report import course_labs

        labs = _labs(args.labs)
        unknown = sorted(set(labs) - set(course_labs()))
        if unknown or not labs:
            print(f"error: no lab {', '.join(unknown)} in this course" if unknown else
                  "error: name the assignment's labs (make gradescope ONLY=06, or --labs 06)", file=sys.stderr)
            return 2
        if args.command == "gradescope-zip":
            print(f"autograder for lab {', '.join(labs)} written to {gradescope.build_zip(args.out, labs)}")
        else:
            results = gradescope.run(args.root, labs)
            print(f"score {results['score']} written to {args.root / 'results' / 'results.json'}")
        return 0
    from labkit_course.grading.integrity import CourseTampered
    from labkit_course.grading.selfcheck import selfcheck

    try:
        return 0 if selfcheck(args.solutions, args.notebooks, args.jobs) else 1
    except CourseTampered as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def _labs(text: str) -> tuple[str, ...]:
    """"0,6" or "00,06" -> ("00", "06")."""
    return tuple(lab.strip().zfill(2) for lab in text.split(",") if lab.strip())


if __name__ == "__main__":
    sys.exit(main())

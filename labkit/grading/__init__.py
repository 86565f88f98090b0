"""Course grading: exercises and check cells, student notebooks, notebook execution, score reports."""

from labkit.grading.core import ExerciseFailed, check, exercise, expect_tensor, require

__all__ = ["ExerciseFailed", "check", "exercise", "expect_tensor", "require"]

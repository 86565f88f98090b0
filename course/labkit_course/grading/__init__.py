"""Course grading: exercises and check cells, student notebooks, notebook execution, score reports."""

from labkit_course.grading.core import (
    ExerciseFailed,
    check,
    exercise,
    expect_tensor,
    expect_value_error,
    raised_type,
    require,
    tensors_close,
)

__all__ = ["ExerciseFailed", "check", "exercise", "expect_tensor", "expect_value_error", "raised_type",
           "require", "tensors_close"]

"""Tripwires reach every way a forbidden object is held: labkit's re-exports, its class attributes,
what a forbidden wrapper wraps, and wrappers handed in as the answer (the red team's S5, S7, S8)."""

import functools
import sys
import types

import pytest

import labkit.model.layers
import labkit.sampling
import labkit.sampling.filters
import labkit.sampling.sampler
import labkit.tokenizer
from labkit_course.grading.forbidden import ForbiddenCall, Tripwires


def test_labkit_re_exports_and_class_attributes_are_armed_and_restored(monkeypatch):
    top_k = labkit.sampling.filters.apply_top_k
    holder = types.ModuleType("labkit.re_export_probe")
    holder.Filters = type("Filters", (), {"__module__": holder.__name__, "top_k": top_k})
    monkeypatch.setitem(sys.modules, holder.__name__, holder)
    re_exports = vars(labkit.sampling.sampler), vars(labkit.sampling)  # what a student can keep from before
    wires = Tripwires(("labkit.sampling.filters.apply_top_k",))
    with wires.armed({}):
        for namespace in re_exports:
            with pytest.raises(ForbiddenCall, match="apply_top_k"):
                namespace["apply_top_k"](None, None)
        with pytest.raises(ForbiddenCall):
            vars(holder.Filters)["top_k"](None, None)
    assert wires.tripped == ["labkit.sampling.filters.apply_top_k"] * 3
    assert all(namespace["apply_top_k"] is top_k for namespace in re_exports)
    assert vars(holder.Filters)["top_k"] is top_k and labkit.sampling.filters.apply_top_k is top_k


def test_what_a_forbidden_wrapper_wraps_is_forbidden_too():
    wrapper = labkit.model.layers.apply_rotary
    raw = vars(wrapper)["__wrapped__"]  # functools.wraps keeps the function it wraps
    namespace = {"rotate": raw}
    wires = Tripwires(("labkit.model.layers.apply_rotary",))
    with wires.armed(namespace):
        with pytest.raises(ForbiddenCall, match="apply_rotary"):
            namespace["rotate"]()
    assert namespace["rotate"] is raw and labkit.model.layers.apply_rotary is wrapper
    with wires.armed({}, functions=(raw,)):
        pass
    assert wires.tripped == ["labkit.model.layers.apply_rotary"] * 2


def test_a_wrapper_of_a_forbidden_function_handed_in_as_the_answer_is_tripped():
    for answer in (functools.lru_cache(maxsize=0)(labkit.tokenizer.merge_pair),
                   functools.partial(functools.lru_cache(labkit.tokenizer.merge_pair))):
        wires = Tripwires(("labkit.tokenizer.merge_pair",))
        with wires.armed({}, functions=(answer,)):
            pass
        assert wires.tripped == ["labkit.tokenizer.merge_pair"], answer


def test_a_student_function_of_its_own_is_not_tripped():
    @functools.lru_cache
    def merge_pair(ids, pair, new_id):
        return ids

    wires = Tripwires(("labkit.tokenizer.merge_pair",))
    with wires.armed({"merge_pair": merge_pair}, functions=(merge_pair,)):
        assert merge_pair((1,), (1, 2), 3) == (1,)
    assert wires.tripped == []

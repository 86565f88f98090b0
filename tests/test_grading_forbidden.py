"""Tripwires reach every way a forbidden object is held: labkit's re-exports, its class attributes,
what a forbidden wrapper wraps, and wrappers handed in as the answer (the red team's S5, S7, S8)."""

import dataclasses
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


def test_a_labkit_class_holding_a_forbidden_function_as_a_staticmethod_is_armed():
    """`Sampler.top_k = staticmethod(apply_top_k)`: the class body holds the wrapper, not the function."""
    from labkit.sampling.sampler import Sampler
    held = vars(Sampler)["top_k"]
    wires = Tripwires(("labkit.sampling.filters.apply_top_k",))
    with wires.armed({}):
        with pytest.raises(ForbiddenCall, match="apply_top_k"):
            Sampler.top_k(None, None)
        with pytest.raises(ForbiddenCall):
            Sampler().top_k(None, None)
    assert vars(Sampler)["top_k"] is held


def test_what_the_students_classes_objects_and_containers_hold_is_armed_and_restored():
    """The red team's hiding places: a class body of the student's own (a renamed method, a staticmethod),
    an object's attribute, a partial, lists, dicts and tuples, a helper's default argument."""
    from labkit.cache.block_manager import BlockManager, pop_free_block
    allocate = BlockManager.allocate

    class Mine(BlockManager):
        alloc = BlockManager.allocate  # renamed, so the source names no forbidden method
        pop = staticmethod(pop_free_block)

    class Box:
        def __init__(self):
            self.parts = {"pop": pop_free_block}

    def helper(x, _pop=pop_free_block):
        return _pop(x)

    box = Box()
    namespace = {"__name__": __name__,  # as a notebook's `__main__`: whose functions and classes are the student's
                 "Mine": Mine, "box": box, "helper": helper, "later": functools.partial(pop_free_block),
                 "boxes": [[pop_free_block]], "pair": (1, pop_free_block), "ok": [1, 2, 3]}
    wires = Tripwires(("labkit.cache.block_manager.BlockManager.allocate",
                       "labkit.cache.block_manager.pop_free_block"))
    calls = [lambda: Mine.alloc(None, None), lambda: Mine.pop(), lambda: box.parts["pop"](),
             lambda: helper(None), lambda: namespace["later"](), lambda: namespace["boxes"][0][0](),
             lambda: namespace["pair"][1]()]
    with wires.armed(namespace):
        for call in calls:
            with pytest.raises(ForbiddenCall):
                call()
        assert namespace["ok"] == [1, 2, 3] and namespace["pair"][0] == 1
    assert len(wires.tripped) == len(calls)
    assert vars(Mine)["alloc"] is allocate and vars(Mine)["pop"].__func__ is pop_free_block
    assert box.parts["pop"] is pop_free_block and helper.__defaults__ == (pop_free_block,)
    assert namespace["later"].func is pop_free_block and namespace["boxes"] == [[pop_free_block]]
    assert namespace["pair"] == (1, pop_free_block)


def test_data_too_long_to_be_a_hiding_place_is_not_looked_into():
    from labkit.cache.block_manager import pop_free_block
    long = [0] * 600 + [pop_free_block]
    wires = Tripwires(("labkit.cache.block_manager.pop_free_block",))
    with wires.armed({"long": long}):
        assert long[-1] is pop_free_block  # beyond HOLDER_WIDTH (in a graded kernel it holds a guard instead)


def test_each_of_labkits_engine_parts_is_forbidden_in_the_exercise_it_answers():
    """engine_parts.labkit_<part> has its exercise's exact signature: one import away from a pass."""
    from labkit_course.engine_parts import EngineParts
    from labkit_course.grading.core import exercises
    graded = {ex.name: ex for lab in ("06", "09", "10", "11") for ex in exercises(lab)}
    for part in (field.name for field in dataclasses.fields(EngineParts)):
        assert f"labkit_course.engine_parts.labkit_{part}" in graded[part].forbidden, part
        assert f"labkit_course.engine_parts.labkit_{part}" in graded["CapstoneParts"].forbidden, part

"""extract/worlds/language3d.py: the widened 3D language's rules on scenes built by hand: object phrases by any
subset of the four attributes, counts with a hidden object, "between" with the middle object off the line, "next to"
with a third object between, and the phrasings with one form per predicate held out of training."""
from __future__ import annotations

import pytest

from extract.worlds import language3d as lang
from extract.worlds import world3d as w3

CAMERA = w3.Camera((0.0, -8.0, 4.0), (0.0, 0.0, 0.4))  # from the front, as random_camera looks


def _scene(*objects: w3.Object3D) -> w3.Scene3D:
    return w3.Scene3D(list(objects), CAMERA, (0.0, 0.0, -1.0))


def _obj(colour, shape, x, y, size="small", material="rubber", **kw) -> w3.Object3D:
    return w3.Object3D(colour, shape, size, material, x, y, **kw)


def test_a_phrase_names_any_subset_of_the_four_attributes_and_matches_by_those_alone():
    cube = _obj("red", "cube", 0, 0, material="metal")
    assert lang.Phrase.of(cube).words() == "small red metal cube"
    assert lang.Phrase.of(cube, ("colour",)).words() == "red thing"
    assert lang.Phrase.of(cube, ("colour",)).words(no_shape_word=1, plural=True) == "red objects"
    assert lang.Phrase.of(cube, ("material",)).words(material_word=1) == "shiny thing"
    assert lang.Phrase(material="rubber").words(material_word=1) == "matte thing"
    assert lang.Phrase.of(cube, ("size", "shape")).words(plural=True) == "small cubes"
    assert lang.Phrase(colour="red").matches(cube) and lang.Phrase(material="metal", shape="cube").matches(cube)
    assert not lang.Phrase(size="large", colour="red").matches(cube)
    assert not lang.Phrase(material="rubber").matches(cube)
    assert lang.Phrase().matches(cube) and lang.Phrase().words() == "thing"  # nothing said: any object
    with pytest.raises(ValueError, match="not a colour"):
        lang.Phrase(colour="mauve")
    with pytest.raises(ValueError, match="no attribute"):
        lang.Phrase.of(cube, ("weight",))


def test_a_count_includes_the_hidden_object_and_a_definite_phrase_must_refer():
    # a small red cube straight behind a large gray cube, as the front camera sees it (the ray over the large cube's
    # back edge passes 0.4 above the small one's top): hidden, still counted
    scene = _scene(_obj("red", "cube", -1.6, -0.8), _obj("gray", "cube", 0.0, 0.0, size="large"),
                   _obj("red", "cube", 0.0, 1.7), _obj("red", "sphere", 1.8, 0.0, material="metal"))
    assert all(w3.clear_of(o, scene.objects[:k]) for k, o in enumerate(scene.objects))  # a scene that can stand
    behind = scene.camera.to_camera(scene.objects[2].centre[None])[0, 2] > \
        scene.camera.to_camera(scene.objects[1].centre[None])[0, 2]
    assert behind  # the hidden one is the farther of the two on the camera's line
    assert lang.count(scene, lang.Phrase(colour="red", shape="cube")) == 2
    assert lang.count(scene, lang.Phrase(colour="red")) == 3 and lang.count(scene, lang.Phrase(shape="cylinder")) == 0
    assert lang.counted(2, lang.Phrase(colour="red", shape="cube")) == "two red cubes"
    assert lang.counted(1, lang.Phrase(material="metal"), material_word=1) == "one shiny thing"
    with pytest.raises(ValueError, match="one to four"):
        lang.counted(5, lang.Phrase(colour="red"))
    assert lang.referent(scene, lang.Phrase(material="metal")) == 3
    assert lang.referent(scene, lang.Phrase(colour="red", shape="cube")) is None  # two of them: no "the"
    assert lang.referent(scene, lang.Phrase(colour="blue")) is None


def test_between_needs_the_middle_object_on_the_line_and_inside_it():
    ends = [_obj("yellow", "cube", -1.6, 0.0), _obj("purple", "cylinder", 1.6, 0.0)]
    on_line = _scene(*ends, _obj("gray", "sphere", 0.1, 0.15))
    assert lang.between(on_line, 2, 0, 1) and lang.between(on_line, 2, 1, 0)  # either order of the ends
    assert not lang.between(on_line, 0, 2, 1)  # an end is not between the middle and the other end
    off_line = _scene(*ends, _obj("gray", "sphere", 0.0, 1.2))  # beside the segment: 0.375 of its length off
    assert not lang.between(off_line, 2, 0, 1) and lang.between(off_line, 2, 0, 1, lenient=True)
    far_off = _scene(*ends, _obj("gray", "sphere", 0.0, 1.6))  # half the segment off it: not even leniently
    assert not lang.between(far_off, 2, 0, 1, lenient=True)
    beyond = _scene(*ends, _obj("gray", "sphere", 2.4, 0.0))  # on the line, past an end
    assert not lang.between(beyond, 2, 0, 1, lenient=True)
    near_an_end = _scene(*ends, _obj("gray", "sphere", -1.0, 0.0))  # inside, but at the first fifth
    assert not lang.between(near_an_end, 2, 0, 1) and lang.between(near_an_end, 2, 0, 1, lenient=True)
    # a stacked middle stands where its base stands
    stacked = _scene(*ends, _obj("blue", "cube", 0.0, 0.0, size="large"), _obj("gray", "sphere", 0.05, 0.0,
                                                                               z=1.4, support=2))
    assert lang.between(stacked, 3, 0, 1) and lang.between(stacked, 2, 0, 1)
    with pytest.raises(ValueError, match="three different"):
        lang.between(on_line, 0, 0, 1)


def test_next_to_is_near_on_one_level_with_nothing_between():
    near = _scene(_obj("red", "sphere", -0.9, 0.0), _obj("blue", "sphere", 0.9, 0.0))  # footprints 1.1 apart
    assert lang.gap(near, 0, 1) == pytest.approx(1.1)
    assert lang.next_to(near, 0, 1) and lang.next_to(near, 1, 0)
    blocked = _scene(*near.objects, _obj("green", "sphere", 0.0, 0.05))  # a third object between the two
    assert lang.between(blocked, 2, 0, 1, lenient=True)
    assert not lang.next_to(blocked, 0, 1) and lang.next_to(blocked, 0, 1, lenient=True)
    assert lang.next_to(blocked, 0, 2) and lang.next_to(blocked, 2, 1)  # each is next to the middle one
    far = _scene(_obj("red", "sphere", -1.5, 0.0), _obj("blue", "sphere", 1.5, 0.0))  # 2.3 apart
    assert not lang.next_to(far, 0, 1) and not lang.next_to(far, 0, 1, lenient=True)
    stack = _scene(_obj("gray", "cube", 0.0, 0.0, size="large"), _obj("red", "sphere", 0.0, 0.0, z=1.4, support=0))
    assert not lang.next_to(stack, 1, 0) and not lang.next_to(stack, 0, 1, lenient=True)  # that is "on"
    upper = _scene(_obj("gray", "cube", -1.2, 0.0, size="large"), _obj("red", "sphere", -1.2, 0.0, z=1.4, support=0),
                   _obj("blue", "sphere", 0.3, 0.0))
    assert lang.gap(upper, 1, 2) < lang.NEAR_GAP and not lang.next_to(upper, 1, 2)  # near, but up on a top


def test_each_predicate_keeps_one_phrasing_out_of_training():
    for predicate, every in lang.PHRASINGS.items():
        train, test = lang.forms(predicate, "train"), lang.forms(predicate, "test")
        assert test == every and set(train) <= set(every) and len(set(every)) == len(every)
        if len(every) > 1:
            assert lang.held_out(predicate) not in train and lang.held_out(predicate) in test
            assert len(train) == len(every) - 1 >= 1
        else:
            assert lang.held_out(predicate) is None and train == every
    assert set(w3.PREDICATES) < set(lang.PHRASINGS)  # every predicate the 3D world says, and the new ones
    assert lang.held_out("on") == "resting on" and "on top of" in lang.forms("on", "train")
    assert lang.forms("behind", "val") == ("behind", "in back of")
    with pytest.raises(ValueError, match="no predicate"):
        lang.forms("above", "train")
    with pytest.raises(ValueError, match="split"):
        lang.forms("on", "dev")


def test_statements_are_decided_on_the_scene_and_their_negatives_fail_even_leniently():
    red = lang.Phrase(colour="red", shape="cube")
    blue, green = lang.Phrase(colour="blue", shape="sphere"), lang.Phrase(colour="green", shape="cylinder")
    # red left of blue on one row; green straight behind red
    scene = _scene(_obj("red", "cube", -1.5, -1.2), _obj("blue", "sphere", 1.0, -1.2),
                   _obj("green", "cylinder", -1.5, 1.3), _obj("red", "cube", 2.0, 1.5, size="large"))
    assert all(w3.clear_of(o, scene.objects[:k]) for k, o in enumerate(scene.objects))
    assert lang.holds(scene, lang.Count(2, red))
    assert lang.is_negative(scene, lang.Count(3, red)) and lang.is_negative(scene, lang.Count(1, red))  # "two" is exact
    assert lang.holds(scene, lang.Related(red, "left of", blue))  # one of the two red cubes is
    assert lang.is_negative(scene, lang.Related(blue, "left of", lang.Phrase(colour="red", size="small")))
    # a conjunction: the subject's second relation; a chain: the object's own
    assert lang.holds(scene, lang.Related(red, "left of", blue, also=("in front of", green)))
    assert lang.is_negative(scene, lang.Related(red, "left of", blue, also=("behind", green)))  # relation replaced
    assert lang.holds(scene, lang.Related(green, "behind", red, then=("left of", blue)))
    assert lang.is_negative(scene, lang.Related(green, "behind", red, then=("right of", blue)))
    # between: the middle swapped with an end is false even leniently
    row = _scene(_obj("yellow", "cube", -1.6, 0.0), _obj("purple", "cylinder", 1.6, 0.0),
                 _obj("gray", "sphere", 0.0, 0.1))
    middle = lang.Between(lang.Phrase(colour="gray"), lang.Phrase(shape="cube"), lang.Phrase(material="rubber",
                                                                                             shape="cylinder"))
    assert lang.holds(row, middle)
    assert lang.is_negative(row, lang.Between(middle.first, middle.subject, middle.second))
    assert lang.is_negative(row, lang.Between(lang.Phrase(material="metal"), middle.first, middle.second))
    assert lang.holds(row, lang.Related(lang.Phrase(colour="gray"), "next to", lang.Phrase(shape="cube")))
    assert not lang.holds(row, lang.Related(lang.Phrase(shape="cube"), "next to", lang.Phrase(shape="cylinder")))
    with pytest.raises(ValueError, match="no 3D rule"):
        lang.holds(row, lang.Related(middle.subject, "above", middle.first))


def test_a_stacked_object_takes_its_stacks_directions_in_the_wide_tables():
    """world3d's own table gives a stacked object no direction; the wide language's says "A on B and right of C"
    where B, A's base, is right of C (a stack stands where its base stands)."""
    base = _obj("purple", "cylinder", 1.5, 0.0, size="large")
    top = _obj("red", "cube", 1.5, 0.0, z=base.top, support=0)
    scene = _scene(base, top, _obj("green", "sphere", -1.5, 0.0))
    assert (0, "right of", 2) in w3.relations(scene) and (1, "right of", 2) not in w3.relations(scene)
    table = lang.relation_table(scene)
    assert [1, "right of", 2] in table and [2, "left of", 1] in table and [1, "on", 0] in table
    assert [1, "right of", 0] not in table  # never a direction within one stack
    cube, cylinder, sphere = (lang.Phrase(shape=s) for s in ("cube", "cylinder", "sphere"))
    assert lang.holds(scene, lang.Related(cube, "on", cylinder, also=("right of", sphere)))
    assert lang.is_negative(scene, lang.Related(cube, "on", cylinder, also=("left of", sphere)))

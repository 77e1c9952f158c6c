"""The rewrite's node order (``_stable_topological_sort``): each node at its position, moved only after what it
reads; held to a plain quadratic reference (pick the smallest position whose producers are all placed), on
graphs whose position order already respects every dependency and on graphs where it does not."""

from __future__ import annotations

import random

import pytest
from onnx import helper

from sgdfuse.passes.rewrite import _stable_topological_sort


def _reference(entries, available):
    producer = {}
    for k, (_, node) in enumerate(entries):
        for name in node.output:
            producer[name] = k
    placed: list[int] = []
    left = set(range(len(entries)))
    while left:
        ready = [
            k for k in left
            if all(producer.get(n) in (None, k) or n in available or producer[n] in placed for n in entries[k][1].input)
        ]
        k = min(ready, key=lambda k: (entries[k][0], k))
        placed.append(k)
        left.remove(k)
    return [entries[k][1] for k in placed]


def _graph(seed: int, shuffled: bool):
    rng = random.Random(seed)
    entries = []
    for k in range(40):
        reads = [f"v{rng.randrange(k)}" for _ in range(rng.randrange(3))] if k else []
        node = helper.make_node("Add", reads or ["x"], [f"v{k}"], name=f"n{k}")
        entries.append(((k, 0), node))
    if shuffled:  # some readers placed before what they read (as a fused output's reader is)
        positions = list(range(40))
        rng.shuffle(positions)
        entries = [((positions[k], j), node) for k, ((_, j), node) in enumerate(entries)]
    return entries


@pytest.mark.parametrize("shuffled", [False, True], ids=["in order", "readers placed early"])
@pytest.mark.parametrize("seed", range(20))
def test_the_order_is_the_smallest_position_ready_first(seed, shuffled):
    entries = _graph(seed, shuffled)
    got = [node.name for node in _stable_topological_sort(entries, available={"x"})]
    assert got == [node.name for node in _reference(entries, {"x"})]


def test_equal_positions_keep_their_entry_order():
    a = helper.make_node("Neg", ["x"], ["a"], name="a")
    b = helper.make_node("Neg", ["x"], ["b"], name="b")
    c = helper.make_node("Neg", ["b"], ["c"], name="c")
    entries = [((5, 1), b), ((5, 1), a), ((2, 0), c)]
    assert [n.name for n in _stable_topological_sort(entries, available={"x"})] == ["b", "c", "a"]


def test_a_cycle_is_reported():
    a = helper.make_node("Neg", ["b"], ["a"], name="a")
    b = helper.make_node("Neg", ["a"], ["b"], name="b")
    with pytest.raises(ValueError, match="cycle"):
        _stable_topological_sort([((0, 0), a), ((1, 0), b)], available=set())

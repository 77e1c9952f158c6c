"""The structural classes (sgdfuse.passes.classes) against the implementation before issue 12.

``tests/classes_reference.py`` keeps the clustering and the keys as they were before they were made in batches
(issue 12): one Python call per value and fact. On every committed model and on generated steps of the
benchmark's families, both must find the same clusters in the same order, with the same outputs, extras,
values and nodes, and keys that are equal exactly when the reference's are: the same partition of the
clusters into classes. The present keys hold numbers for the facts, columns for the values' entries and the
permutation that sorts the names where the reference held the facts, an entry per value and each name's rank;
decoded back (numbers to facts, columns to entries, permutation to ranks) they must be the reference's keys,
tuple for tuple. The expected values come from the reference, never from
the code under test.
"""

from __future__ import annotations

import sys
from pathlib import Path

import onnx
import pytest
from graphs import bench_generator

sys.path.insert(0, str(Path(__file__).resolve().parent))

import classes_reference as reference  # noqa: E402
from sgdfuse.passes import classes, sgd_match  # noqa: E402
from sgdfuse.passes.index import build_index  # noqa: E402
from sgdfuse.passes.linear import ONE, Normaliser  # noqa: E402
from sgdfuse.passes.sgd_match import RolePins  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODELS = sorted(ROOT.glob("testdata/**/*.onnx"))
PINS = {"none": RolePins(), "buffer-globs": RolePins(buffers=("*buf*", "*momentum*"))}


def _bench_model(size: int) -> onnx.ModelProto:
    model, _ = bench_generator().build(size)
    return model


def _both(model: onnx.ModelProto, pins: RolePins, monkeypatch) -> tuple[list, list, classes._Walker]:
    """(the reference's clusters, the present clusters, the walker that numbered the present keys' facts)."""
    index = build_index(model)
    normaliser = Normaliser(index)
    outputs = [o for o in dict.fromkeys(index.graph_outputs) if index.spec(o).dtype in sgd_match._EPS]
    named_next = sgd_match._named_next(index, outputs, pins)

    def form_leaves(output: str) -> set[str]:
        return set(normaliser.form(output)) - {ONE}

    expected = list(reference.clusters_of(index, outputs, reference.name_facts_of(index, pins, named_next), form_leaves))
    walkers: list[classes._Walker] = []

    class Recording(classes._Walker):
        def __init__(self, index) -> None:
            super().__init__(index)
            walkers.append(self)

    monkeypatch.setattr(classes, "_Walker", Recording)
    actual = list(classes.clusters_of(index, outputs, sgd_match.name_facts_of(index, pins, named_next), form_leaves))
    return expected, actual, walkers[0]


def _decoded(key: tuple | None, walker: classes._Walker) -> tuple | None:
    """A present key in the reference's terms: facts for their numbers, an entry per value for the columns, each
    name's rank for the permutation."""
    if key is None:
        return None
    outputs, extras, (facts, nodes, arities, inputs), (by_name, before, tails), read_outside = key
    entries, at = [], 0
    for number, node, arity in zip(facts, nodes, arities):
        if arity < 0:
            entries.append((walker.facts_of(number), "operand of a leaf's producer"))
        else:
            entries.append((walker.facts_of(number), node, tuple(inputs[at:at + arity])))
            at += arity
    assert at == len(inputs)
    ranks = [0] * len(by_name)
    for rank, position in enumerate(by_name):
        ranks[position] = rank
    names = tuple((rank, place) + tail for rank, place, tail in zip(ranks, before, tails))
    return outputs, extras, tuple(entries), names, read_outside


def _partition(keys: list) -> list[int]:
    """Each cluster's class, numbered by first appearance (None keys apart)."""
    seen: dict = {}
    return [-1 if key is None else seen.setdefault(key, len(seen)) for key in keys]


def _check(expected: list, actual: list, walker: classes._Walker) -> None:
    assert [(c.outputs, c.extras, c.values, c.nodes) for c in actual] == [(c.outputs, c.extras, c.values, c.nodes) for c in expected]
    assert _partition([c.key for c in actual]) == _partition([c.key for c in expected])
    assert [_decoded(c.key, walker) for c in actual] == [c.key for c in expected]


@pytest.mark.parametrize("pins", PINS.values(), ids=PINS.keys())
@pytest.mark.parametrize("path", MODELS, ids=[str(p.relative_to(ROOT / "testdata")) for p in MODELS])
def test_committed_models_cluster_and_key_as_the_reference(path, pins, monkeypatch):
    expected, actual, walker = _both(onnx.load(path, load_external_data=False), pins, monkeypatch)
    _check(expected, actual, walker)


@pytest.mark.parametrize("size", [60, 1000])
def test_benchmark_steps_cluster_and_key_as_the_reference(size, monkeypatch):
    expected, actual, walker = _both(_bench_model(size), RolePins(), monkeypatch)
    assert sum(c.key is not None for c in actual) > size // 2  # most updates are keyed, not solved directly
    _check(expected, actual, walker)


def test_keys_made_one_cluster_at_a_time_equal_the_batch_keys(monkeypatch):
    # A batch is keyed as a whole unless a value is in two of its clusters or a node computes two of its
    # values; the cluster-by-cluster path must give the very same keys.
    model = _bench_model(300)
    _, together, _ = _both(model, RolePins(), monkeypatch)

    def alone(walker, tables, local, computed, nodes, shared):
        for j in range(len(tables.clusters)):
            classes._key_alone(walker, tables, j, shared)

    monkeypatch.setattr(classes, "_key_together", alone)
    expected, actual, walker = _both(model, RolePins(), monkeypatch)
    assert [(c.values, c.nodes, c.key) for c in actual] == [(c.values, c.nodes, c.key) for c in together]
    _check(expected, actual, walker)

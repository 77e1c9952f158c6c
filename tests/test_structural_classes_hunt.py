"""Graphs on which the per-class matcher (sgdfuse.passes.classes) and the direct matcher disagree.

Each graph here was built to break the structural class key or the clustering it rests on. The expected
result is the direct matcher's (``sgd_match._find`` over the whole graph, with no pins) and what the graph's
own construction says (which value is written in place by how many updates); the per-class path is run with
the suite-wide check turned off, so that a test states what differs instead of failing inside the check.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from onnx import helper

sys.path.insert(0, str(Path(__file__).resolve().parent))

from graphs import F32, make_model, scalar, value  # noqa: E402
from sgdfuse.passes import sgd_match  # noqa: E402
from sgdfuse.passes.index import build_index  # noqa: E402
from sgdfuse.passes.linear import Normaliser  # noqa: E402
from sgdfuse.passes.sgd_match import MEMO_CHECK_ENV, RolePins, find_updates  # noqa: E402


def _update(k: int, *, shape=(2, 3), p: str | None = None, buf: str | None = None, p_out: str | None = None,
            buf_out: str | None = None):
    """``buf_out = 0.9*buf + g; p_out = p - 0.1*buf_out`` with names suffixed ``k`` (or as given); inputs
    are declared for the names not given (a shared name is declared once by the caller)."""
    p_name, buf_name, g = p or f"p{k}", buf or f"buf{k}", f"g{k}"
    p_out = p_out or f"{p_name}_out"
    buf_out = buf_out or f"{buf_name}_out"
    nodes = [
        helper.make_node("Mul", [buf_name, f"m{k}"], [f"scaled{k}"]),
        helper.make_node("Add", [f"scaled{k}", g], [buf_out]),
        helper.make_node("Mul", [buf_out, f"lr{k}"], [f"step{k}"]),
        helper.make_node("Sub", [p_name, f"step{k}"], [p_out]),
    ]
    inputs = [value(name, F32, shape) for name, given in ((p_name, p), (g, None), (buf_name, buf)) if given is None]
    outputs = [value(p_out, F32, shape), value(buf_out, F32, shape)]
    return nodes, inputs, outputs, [scalar(f"m{k}", 0.9), scalar(f"lr{k}", 0.1)]


def _model(updates, *, inputs=(), nodes_after=(), outputs_after=(), initializers=()):
    nodes, graph_inputs, outputs, inits = [], list(inputs), [], list(initializers)
    for n, i, o, t in updates:
        nodes += n
        graph_inputs += i
        outputs += o
        inits += t
    return make_model(nodes + list(nodes_after), graph_inputs, outputs + list(outputs_after), inits)


def _both(model, monkeypatch):
    """(per-class result, direct result), each as comparable tuples."""
    monkeypatch.setenv(MEMO_CHECK_ENV, "0")
    index = build_index(model)
    by_class = find_updates(index, Normaliser(index))
    index = build_index(model)
    direct = sgd_match._find(index, Normaliser(index), list(dict.fromkeys(index.graph_outputs)), RolePins(), False, {})
    return _plain(by_class), _plain(direct)


def _plain(result):
    matches, misses = result
    return (
        [(m.parameters, m.gradient, m.accum, m.parameters_out, m.accum_out, sgd_match.format_poly(m.learning_rate),
          sgd_match.format_poly(m.momentum), m.dampening, m.nesterov, m.roles_from, sorted(m.nodes)) for m in matches],
        sorted((m.candidate, m.reason, m.detail) for m in misses),
    )


# -- one-element state read by many regions -------------------------------------------------------------------
# A one-element value read by more than SHARED_SCALAR_REGIONS regions links no clusters (it is taken for a
# learning rate). When it is state (a buffer or a parameter of one element), each update sharing it is solved
# in its own cluster and the whole-graph one-writer rule never sees the others: every update is fused, all
# writing the same tensor in place. Three updates sharing a buffer are six regions (p_out and buf_out both read
# it); a parameter is read by p_out only, so five updates.


def test_a_one_element_buffer_read_by_three_updates_is_written_by_one_fused_update_only(monkeypatch):
    updates = [_update(k, shape=(1,), buf="buf", buf_out=f"buf_out{k}") for k in range(3)]
    model = _model(updates, inputs=[value("buf", F32, [1])])
    by_class, direct = _both(model, monkeypatch)
    # The graph's construction: buf is one tensor; a fused update writes its buffer in place.
    assert [m[2] for m in direct[0]] == ["buf"]
    assert [(candidate, reason) for candidate, reason, _ in direct[1]] == [("p1_out", "shared-state"), ("p2_out", "shared-state")]
    assert [m[2] for m in by_class[0]].count("buf") <= 1
    assert by_class == direct


def test_a_one_element_parameter_read_by_five_updates_is_written_by_one_fused_update_only(monkeypatch):
    updates = [_update(k, shape=(1,), p="p", p_out=f"p_out{k}") for k in range(5)]
    model = _model(updates, inputs=[value("p", F32, [1])])
    by_class, direct = _both(model, monkeypatch)
    assert [m[0] for m in direct[0]] == ["p"]
    assert [m[0] for m in by_class[0]].count("p") <= 1
    assert by_class == direct


# -- outputs computed from shared values alone ("loose") ------------------------------------------------------
# A one-element update whose new value is read by three more outputs: buf_out is read by five regions, so it
# links nothing, and its leaves (buf, g) are read by five regions too, so buf_out counts as computed from shared
# values alone. It is then solved on its own with the other such outputs, where nothing reads it as a buffer,
# and refused as an update without a buffer; the direct matcher tried it as p_out's buffer and reports nothing.


def _scalar_update_with_readers(reads: str):
    readers = [helper.make_node("Mul", [reads, f"c{j}"], [f"d{j}"]) for j in range(3)]
    return _model(
        [_update(0, shape=(1,))],
        nodes_after=readers,
        outputs_after=[value(f"d{j}", F32, [1]) for j in range(3)],
        initializers=[scalar(f"c{j}", 2.0 + j) for j in range(3)],
    )


def test_the_buffer_of_a_fused_one_element_update_read_by_three_outputs_is_not_refused(monkeypatch):
    by_class, direct = _both(_scalar_update_with_readers("p0_out"), monkeypatch)
    assert [m[3:5] for m in direct[0]] == [("p0_out", "buf0_out")]
    assert direct[1] == []
    assert by_class == direct


def test_outputs_reading_the_new_buffer_of_a_fused_one_element_update_are_readers_not_refusals(monkeypatch):
    by_class, direct = _both(_scalar_update_with_readers("buf0_out"), monkeypatch)
    assert [m[3:5] for m in direct[0]] == [("p0_out", "buf0_out")]
    assert direct[1] == []
    assert by_class == direct


# -- regions cut at MAX_REGION --------------------------------------------------------------------------------
# The region walk stops at MAX_REGION values. A buffer output whose region is longer (here a chain of copies)
# lists none of its leaves: it neither links with the parameter update that reads the same leaves (through its
# own m*buf + g), nor has a leaf that is not shared, so it is taken as computed from shared values alone.


def _long_buffer(copy_op: str, chain: int = 600):
    k = 0
    nodes = [
        helper.make_node("Mul", [f"buf{k}", "m"], [f"scaled{k}"]),
        helper.make_node("Add", [f"scaled{k}", f"g{k}"], ["v0"]),
        *[helper.make_node("Identity", [f"v{i}"], [f"v{i + 1}"]) for i in range(chain)],
        # The parameter update computes 0.9*buf + g itself (it does not read the buffer output).
        helper.make_node("Mul", [f"buf{k}", "m"], ["again"]),
        helper.make_node("Add", ["again", f"g{k}"], ["velocity"]),
        helper.make_node("Mul", ["velocity", "lr"], ["step"]),
        helper.make_node("Sub", [f"p{k}", "step"], ["p_new"]),
    ]
    inputs = [value(f"p{k}"), value(f"g{k}"), value(f"buf{k}")]
    if copy_op == "Identity":
        nodes.append(helper.make_node("Identity", [f"v{chain}"], ["buf_new"]))
    else:
        # CastLike reads a second tensor that is in no other region: the buffer's region is not "loose".
        nodes.append(helper.make_node("CastLike", [f"v{chain}", "like"], ["buf_new"]))
        inputs.append(value("like"))
    return make_model(nodes, inputs, [value("p_new"), value("buf_new")], [scalar("m", 0.9), scalar("lr", 0.1)])


@pytest.mark.parametrize("copy_op", ["Identity", "CastLike"])
def test_a_buffer_output_behind_a_long_chain_of_copies_is_matched_as_directly(copy_op, monkeypatch):
    by_class, direct = _both(_long_buffer(copy_op), monkeypatch)
    # The graph's construction: p_new = p0 - 0.1*(0.9*buf0 + g0), buf_new = 0.9*buf0 + g0.
    assert [m[:5] for m in direct[0]] == [("p0", "g0", "buf0", "p_new", "buf_new")]
    assert direct[1] == []
    assert by_class == direct

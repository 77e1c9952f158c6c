"""The per-class matcher (sgdfuse.passes.classes) against the direct one, on graphs built to break it.

The first part holds graphs on which the two disagree (the clustering's one-element rule, outputs computed
from shared values alone, regions cut at MAX_REGION, names reached only through a shared value); the second,
exporter patterns from public reports (outputs returned twice, inputs returned as outputs, exporters' value
names, tied weights, deduplicated constants, first-step rules, overflow skips), on which they agree. The
expected result is the direct matcher's (``sgd_match._find`` over the whole graph, with no pins) and what the
graph's own construction says (which value is written in place by how many updates); the per-class path is run
with the suite-wide check turned off, so that a test states what differs instead of failing inside the check.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

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
    normaliser, outputs = Normaliser(index), list(dict.fromkeys(index.graph_outputs))
    direct = sgd_match._find(index, normaliser, outputs, RolePins(), False, {})
    # The outputs that read a fused update's new values are solved after matching, over the whole graph, as
    # find_updates does (the readers of an update, lr*buf_out, are dropped there).
    canonical = {o: sgd_match._skip_copies(index, o) for o in outputs}
    direct = sgd_match._solve_readers_of_fused(index, normaliser, outputs, canonical, *direct, RolePins(), False)
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


def test_one_element_zero_buffers_merged_by_an_initializer_deduplication_are_written_once(monkeypatch):
    # The state of one-element parameters (PReLU slopes of shape [1]) kept as initializers that are also graph
    # inputs (keep_initializers_as_inputs), with zero momentum buffers: a pass that merges initializers of equal
    # dtype, shape and bytes (onnx-ir's DeduplicateInitializersPass compares only those) leaves every update
    # reading one buffer, val_2. Four updates read it from eight regions.
    updates = [_update(k, shape=(1,), buf="val_2", buf_out=f"momentum_buffer.{k}_out") for k in range(4)]
    zeros = numpy_helper.from_array(np.zeros([1], np.float32), "val_2")
    model = _model(updates, inputs=[value("val_2", F32, [1])], initializers=[zeros])
    by_class, direct = _both(model, monkeypatch)
    assert [m[2] for m in direct[0]] == ["val_2"]
    assert [candidate for candidate, reason, _ in direct[1] if reason == "shared-state"] == ["p1_out", "p2_out", "p3_out"]
    assert [m[2] for m in by_class[0]].count("val_2") <= 1
    assert by_class == direct


def test_the_optimized_model_writes_a_deduplicated_one_element_buffer_with_one_sgd_node(monkeypatch):
    # The consequence in the model: each SGD node writes its accum input in place, so two nodes reading val_2
    # as accum would both write it. The per-class check is off, as a user runs optimize.
    import sgdfuse
    from sgdfuse.fused_op import INPUT_NAMES

    updates = [_update(k, shape=(1,), buf="val_2", buf_out=f"momentum_buffer.{k}_out") for k in range(4)]
    zeros = numpy_helper.from_array(np.zeros([1], np.float32), "val_2")
    model = _model(updates, inputs=[value("val_2", F32, [1])], initializers=[zeros])
    monkeypatch.setenv(MEMO_CHECK_ENV, "0")
    result = sgdfuse.optimize(model, verify=False)
    accum = INPUT_NAMES.index("accum")
    writers = [node.name for node in result.model.graph.node if node.op_type == "SGD" and node.input[accum] == "val_2"]
    assert len(writers) <= 1, writers


# -- names reached only through a shared value ---------------------------------------------------------------
# The key places each local name among the shared names the cluster reads directly. A one-element update reads
# its leaves through a shared one-element value (S2 = Identity(S), S = ga + gb, read by six regions), so S, ga
# and gb are in its forms and cone, and the matcher sorts them with the local names: the gradient is the first
# value, by name, that computes the gradient term (grad0/S/S2 here). Member 0 names its copy "A0" (before "S"),
# member 1 "S1" (after "S", before "S2"): the same key, but the first value by name is A0 for one and S for the
# other.


def test_the_gradient_of_a_one_element_update_is_the_one_the_direct_matcher_names(monkeypatch):
    def update(k: int, copy: str):
        nodes = [
            helper.make_node("Identity", ["S2"], [copy]),
            helper.make_node("Mul", [f"xbuf{k}", f"xm{k}"], [f"xscaled{k}"]),
            helper.make_node("Add", [f"xscaled{k}", copy], [f"xbuf{k}_out"]),
            helper.make_node("Mul", [f"xbuf{k}_out", f"xlr{k}"], [f"xstep{k}"]),
            helper.make_node("Sub", [f"xp{k}", f"xstep{k}"], [f"xp{k}_out"]),
        ]
        return (nodes, [value(f"xp{k}", F32, [1]), value(f"xbuf{k}", F32, [1])],
                [value(f"xp{k}_out", F32, [1]), value(f"xbuf{k}_out", F32, [1])], [scalar(f"xm{k}", 0.9), scalar(f"xlr{k}", 0.1)])

    shared = [helper.make_node("Add", ["ga", "gb"], ["S"]), helper.make_node("Identity", ["S"], ["S2"])]
    nodes, inputs, outputs, initializers = shared, [value("ga", F32, [1]), value("gb", F32, [1])], [], []
    for k, copy in enumerate(["A0", "S1", "A2"]):
        n, i, o, t = update(k, copy)
        nodes, inputs, outputs, initializers = nodes + n, inputs + i, outputs + o, initializers + t
    by_class, direct = _both(make_model(nodes, inputs, outputs, initializers), monkeypatch)
    # Sorted by name, the values computing ga + gb are A0 | S, S1, S2 | A2, S, S2: the first is the gradient.
    assert [m[1] for m in direct[0]] == ["A0", "S", "A2"]
    assert by_class == direct


# -- exporter patterns from public reports (these agree today) -----------------------------------------------
# Each builds several updates of one structure, so that classes form, and puts the exporter's pattern in some
# members only. The expected fused updates come from the construction; the per-class result must also equal the
# direct one.


def _fused(by_class):
    return [m[3:5] for m in by_class[0]]


def test_outputs_returned_twice_as_identity_copies_fuse_as_directly(monkeypatch):
    # `return y, y`: exporters keep output names unique with an Identity per repeat (y_copy, y_copy_0, ...), and
    # the copies may come first in the output list.
    copies = [
        helper.make_node("Identity", ["p1_out"], ["p1_out_copy"]),
        helper.make_node("Identity", ["buf2_out"], ["buf2_out_copy"]),
        helper.make_node("Identity", ["buf2_out"], ["buf2_out_copy_0"]),
    ]
    model = _model([_update(k) for k in range(4)], nodes_after=copies)
    outputs = list(model.graph.output)
    del model.graph.output[:]
    model.graph.output.extend([value("p1_out_copy"), value("buf2_out_copy"), value("buf2_out_copy_0")] + outputs)
    by_class, direct = _both(model, monkeypatch)
    assert by_class == direct
    # Each parameter is updated by one fused update (through the copy or the original, whichever comes first).
    assert sorted(m[0] for m in by_class[0]) == ["p0", "p1", "p2", "p3"]


def test_a_name_listed_twice_among_the_graph_outputs_fuses_once(monkeypatch):
    model = _model([_update(k) for k in range(4)])
    model.graph.output.extend([value("p1_out"), value("buf3_out")])  # ONNX allows a repeated output name
    by_class, direct = _both(model, monkeypatch)
    assert by_class == direct
    assert _fused(by_class) == [(f"p{k}_out", f"buf{k}_out") for k in range(4)]


def test_inputs_returned_as_outputs_without_an_identity_fuse_as_directly(monkeypatch):
    # The torch.export-based exporter returns an input as an output of the same name (no Identity): frozen
    # parameters passed through, and here also an update's own buffer and parameters.
    model = _model([_update(k) for k in range(4)], inputs=[value("frozen0"), value("frozen1")])
    model.graph.output.extend([value("frozen0"), value("frozen1"), value("buf1"), value("p2")])
    by_class, direct = _both(model, monkeypatch)
    assert by_class == direct
    assert _fused(by_class) == [(f"p{k}_out", f"buf{k}_out") for k in range(4)]


def _exporter_named_update(k: int, names: list[str], momentum: str, lr: str):
    """An update whose intermediates and outputs carry the exporter's names ``names`` (4 of them)."""
    scaled, buf_out, step, p_out = names
    nodes = [
        helper.make_node("Mul", [f"momentum_buffer.{k}", momentum], [scaled]),
        helper.make_node("Add", [scaled, f"grad.{k}"], [buf_out]),
        helper.make_node("Mul", [buf_out, lr], [step]),
        helper.make_node("Sub", [f"layer{k}.weight", step], [p_out]),
    ]
    inputs = [value(f"layer{k}.weight"), value(f"grad.{k}"), value(f"momentum_buffer.{k}")]
    return nodes, inputs, [value(p_out), value(buf_out)], []


@pytest.mark.parametrize(
    "style",
    ["torch.export", "torchscript"],
)
def test_exporter_value_names_whose_order_differs_from_creation_order_fuse_as_directly(style, monkeypatch):
    # torch.export names values val_<n> (val_10 sorts before val_2); the TorchScript exporter uses bare numbers
    # (1000 sorts before 13) and onnx::Mul_<n> for lifted constants. The same update gets names of another order
    # relative to one another from one parameter to the next.
    bases = [3, 7, 96, 100, 996, 1000, 20, 24]
    if style == "torch.export":
        names = [[f"val_{b + i}" for i in range(4)] for b in bases]
        momentum, lr = "val_2", "val_11"
    else:
        names = [[str(b + i) for i in range(4)] for b in bases]
        momentum, lr = "onnx::Mul_8", "onnx::Mul_9"
    updates = [_exporter_named_update(k, n, momentum, lr) for k, n in enumerate(names)]
    model = _model(updates, initializers=[scalar(momentum, 0.9), scalar(lr, 0.1)])
    by_class, direct = _both(model, monkeypatch)
    assert by_class == direct
    assert _fused(by_class) == [(n[3], n[1]) for n in names]
    assert [m[0] for m in by_class[0]] == [f"layer{k}.weight" for k in range(8)]


def test_tied_weights_updated_once_from_two_gradient_contributions_fuse_as_directly(monkeypatch):
    # A tied weight (embedding and output projection) has one update whose gradient sums two MatMul results.
    tied = _update(9, p="emb")
    tied_inputs = [i for i in tied[1] if i.name != "g9"]
    contributions = [
        helper.make_node("MatMul", ["X", "dY1"], ["g_use1"]),
        helper.make_node("MatMul", ["X", "dY2"], ["g_use2"]),
        helper.make_node("Add", ["g_use1", "g_use2"], ["g9"]),
    ]
    updates = [_update(k) for k in range(3)] + [(contributions + tied[0], tied_inputs, tied[2], tied[3])]
    model = _model(updates, inputs=[value("emb"), value("X", F32, [2, 5]), value("dY1", F32, [5, 3]), value("dY2", F32, [5, 3])])
    by_class, direct = _both(model, monkeypatch)
    assert by_class == direct
    assert ("emb", "g9", "buf9") == by_class[0][-1][:3]


def test_deduplicated_hyper_parameter_constants_fuse_as_directly(monkeypatch):
    # Equal-valued constants merged into one initializer (val_2, val_11) for some updates, left per update for
    # others, and merged into another pair (val_69, val_70) for one: three spellings of one update.
    def update(k, lr, m):
        nodes, inputs, outputs, _ = _update(k)
        nodes[0] = helper.make_node("Mul", [f"buf{k}", m], [f"scaled{k}"])
        nodes[2] = helper.make_node("Mul", [f"buf{k}_out", lr], [f"step{k}"])
        return nodes, inputs, outputs, []

    updates = [update(0, "val_2", "val_11"), update(1, "val_2", "val_11"), _update(2), update(3, "val_2", "val_11"), update(4, "val_69", "val_70")]
    constants = [scalar("val_2", 0.1), scalar("val_11", 0.9), scalar("val_69", 0.1), scalar("val_70", 0.9)]
    by_class, direct = _both(_model(updates, initializers=constants), monkeypatch)
    assert by_class == direct
    assert [(m[5], m[6]) for m in by_class[0]] == [("0.1", "0.9")] * 5


def _step_rule_update(k: int, rule: str):
    """``later = 0.9*buf + g``; the buffer output is ``later`` as it is, or PyTorch's first step
    ``Where(is_first, g, later)`` (``buf = clone(grad)``), or that with the condition negated."""
    nodes = [helper.make_node("Mul", [f"buf{k}", f"m{k}"], [f"scaled{k}"]), helper.make_node("Add", [f"scaled{k}", f"g{k}"], [f"later{k}"])]
    if rule == "first-step":
        nodes.append(helper.make_node("Where", ["is_first", f"g{k}", f"later{k}"], [f"buf{k}_out"]))
    elif rule == "first-step-negated":
        nodes += [helper.make_node("Not", ["is_first"], [f"later_step{k}"]), helper.make_node("Where", [f"later_step{k}", f"later{k}", f"g{k}"], [f"buf{k}_out"])]
    else:
        nodes.append(helper.make_node("Identity", [f"later{k}"], [f"buf{k}_out"]))
    nodes += [helper.make_node("Mul", [f"buf{k}_out", f"lr{k}"], [f"step{k}"]), helper.make_node("Sub", [f"p{k}", f"step{k}"], [f"p{k}_out"])]
    return nodes, [value(f"p{k}"), value(f"g{k}"), value(f"buf{k}")], [value(f"p{k}_out"), value(f"buf{k}_out")], [scalar(f"m{k}", 0.9), scalar(f"lr{k}", 0.1)]


def test_first_step_rules_in_some_members_only_fuse_as_directly(monkeypatch):
    # PyTorch's SGD starts the buffer as a copy of the gradient; one exported step may hold updates with and
    # without the rule (a parameter that already has a buffer).
    rules = ["first-step", "plain", "first-step", "first-step-negated", "plain"]
    model = _model([_step_rule_update(k, r) for k, r in enumerate(rules)], inputs=[value("is_first", TensorProto.BOOL, [])])
    by_class, direct = _both(model, monkeypatch)
    assert by_class == direct
    assert _fused(by_class) == [(f"p{k}_out", f"buf{k}_out") for k in range(5)]


def test_an_overflow_skip_that_guards_only_some_buffers_says_so_for_those(monkeypatch):
    # A loss-scaling skip step written as Where(found_inf, old, new): fused SGD kernels that advance the
    # momentum on skipped steps are a known bug; here updates 1 and 3 guard their parameters but not their
    # buffers, so the graph itself moves the buffer on a skipped step. The fused node does exactly that too
    # (its buffer output is the graph's), so those fuse, and their guard says the buffer moves on every step.
    # find_updates runs the class check (conftest).
    def update(k: int, guard_buffer: bool):
        nodes = [
            helper.make_node("Mul", [f"buf{k}", f"m{k}"], [f"scaled{k}"]),
            helper.make_node("Add", [f"scaled{k}", f"g{k}"], [f"new_buf{k}"]),
            helper.make_node("Mul", [f"new_buf{k}", f"lr{k}"], [f"step{k}"]),
            helper.make_node("Sub", [f"p{k}", f"step{k}"], [f"new_p{k}"]),
            helper.make_node("Where", ["found_inf", f"p{k}", f"new_p{k}"], [f"p{k}_out"]),
            helper.make_node("Where", ["found_inf", f"buf{k}", f"new_buf{k}"], [f"buf{k}_out"]) if guard_buffer
            else helper.make_node("Identity", [f"new_buf{k}"], [f"buf{k}_out"]),
        ]
        return nodes, [value(f"p{k}"), value(f"g{k}"), value(f"buf{k}")], [value(f"p{k}_out"), value(f"buf{k}_out")], [scalar(f"m{k}", 0.9), scalar(f"lr{k}", 0.1)]

    model = _model([update(k, k % 2 == 0) for k in range(4)], inputs=[value("found_inf", TensorProto.BOOL, [])])
    monkeypatch.setenv(MEMO_CHECK_ENV, "1")
    index = build_index(model)
    found, refused = find_updates(index, Normaliser(index))
    assert sorted((m.parameters_out, m.guard.output, m.guard.only) for m in found) == [
        ("new_p0", "p0_out", ""), ("new_p1", "p1_out", "parameters"), ("new_p2", "p2_out", ""), ("new_p3", "p3_out", "parameters")
    ]
    assert [m.accum_out for m in found if m.guard.only] == ["buf1_out", "buf3_out"]  # the Identity of the unguarded new buffer
    assert refused == []

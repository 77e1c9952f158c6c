"""The native region walk of the structural classes (sgdfuse/passes/_classes.cc) against its Python fallback.

``classes._steps``, ``classes._walk_regions``, ``classes._union``, ``_Walker.facts`` and the per-cluster loop of
``classes._key_together`` run natively where the extension builds; the Python functions ``_steps_python``,
``_walk_regions_python``, ``_union_python``, ``_Walker.facts_python`` and the loop itself are the fallback (no compiler, or
``SGDFUSE_NATIVE_SCAN=0``). Both must build the same tables, dicts in the same insertion order, lists in the
same order, sets equal, on every committed model, on generated benchmark steps and on hand-made graphs with
the cases the benchmark lacks (multi-output nodes, an entered op with attributes, a subgraph, a fringe, an
output walked inside another's region, a region past MAX_WALK). The expected values are the Python
functions' (the implementation the matcher has always used), never the native code's; and the classes
themselves (``clusters_of``: clusters, values, nodes, keys) must be the same with the native walk on and off.
"""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from graphs import bench_generator
from onnx import TensorProto, helper

from sgdfuse.passes import classes, sgd_match
from sgdfuse.passes.index import build_index
from sgdfuse.passes.linear import ONE, Normaliser
from sgdfuse.passes.scan import NATIVE_ENV
from sgdfuse.passes.sgd_match import RolePins

ROOT = Path(__file__).resolve().parent.parent
MODELS = sorted(ROOT.glob("testdata/**/*.onnx"))


def _native():
    native = classes._native()
    if native is None:
        pytest.skip("the native region walk does not build here (no compiler or no Python headers)")
    return native


def _bench_model(size: int) -> onnx.ModelProto:
    model, _ = bench_generator().build(size)
    return model


def _ordered(table: dict) -> list:
    """A dict as its items in insertion order (``==`` on dicts ignores the order, which the walk keeps)."""
    return list(table.items())


def _assert_same_walk(model: onnx.ModelProto) -> None:
    index = build_index(model)
    native = _native()
    steps, copies = classes._steps_python(index.nodes)
    native_steps, native_copies = native.steps(index.nodes, classes.ENTERED_OPS, classes.DIRECT_OPS, classes._COPY_OPS, classes._DEFAULT_DOMAINS)
    assert _ordered(native_steps) == _ordered(steps)
    assert native_copies == copies
    assert classes._steps(index.nodes)[0] == steps  # the dispatcher takes the native path on the index's list
    walker = classes._Walker(index)
    outputs = list(index.graph_outputs)
    try:
        expected = classes._walk_regions_python(walker, outputs)
    except classes._TooLarge as error:
        with pytest.raises(classes._TooLarge) as raised:
            classes._walk_regions(walker, outputs)
        assert str(raised.value) == str(error)
        return
    found = classes._walk_regions(walker, outputs)
    for field in ("regions", "steps", "fringes", "leaves"):
        assert _ordered(getattr(found, field)) == _ordered(getattr(expected, field)), field
    assert found.direct == expected.direct
    assert _ordered(found.appearances) == _ordered(expected.appearances)
    for output, fringe in expected.fringes.items():
        assert (found.fringes[output] is classes._NOTHING) == (fringe is classes._NOTHING), output
    # The facts of every region's values, numbered by two fresh walkers, in batches as _key_batch asks.
    values = [v for o in outputs if expected.regions.get(o) for v in expected.regions[o]]
    steps = [s for o in outputs if expected.regions.get(o) for s in expected.steps[o]]
    steps = [walker.step(v) if s is classes._LISTED else s for v, s in zip(values, steps)]
    python_walker, native_walker = classes._Walker(index), classes._Walker(index)
    for start in range(0, len(values), 500):
        batch, batch_steps = values[start:start + 500], steps[start:start + 500]
        assert native_walker.facts(batch, batch_steps) == python_walker.facts_python(batch, batch_steps)
    assert native_walker._facts == python_walker._facts and native_walker._numbers == python_walker._numbers
    assert native_walker._reads_names == python_walker._reads_names
    cluster_of, members, unlinked = classes._union_python(walker, outputs, expected.appearances)
    native_cluster_of, native_members, native_unlinked = classes._union(walker, outputs, found.appearances)
    assert _ordered(native_cluster_of) == _ordered(cluster_of)
    assert _ordered(native_members) == _ordered(members)
    assert native_unlinked == unlinked


def test_native_walk_builds():
    assert _native() is not None


@pytest.mark.parametrize("path", MODELS, ids=[str(p.relative_to(ROOT)) for p in MODELS])
def test_every_testdata_model_walks_the_same_natively(path):
    _assert_same_walk(onnx.load(path))


@pytest.mark.parametrize("size", [1, 7, 60])
def test_generated_bench_steps_walk_the_same_natively(size):
    _assert_same_walk(_bench_model(size))


def _hand_made(max_walk: bool = False) -> onnx.ModelProto:
    """Updates whose regions hold what the benchmark does not: a two-output ``Split`` (not entered) and a
    two-output entered op with an attribute, a ``Cast`` (an entered op with an attribute), an ``If`` (a
    subgraph), a ``MatMul`` leaf whose operands are listed (a fringe) and one of which is a graph output's
    value, and an output computed inside another output's region."""
    f = TensorProto.FLOAT
    branch = helper.make_graph([helper.make_node("Identity", ["c"], ["y"])], "b", [], [helper.make_tensor_value_info("y", f, [4])])
    nodes = [
        helper.make_node("Split", ["g0"], ["s0", "s1"], axis=0),
        helper.make_node("Add", ["s0", "s1"], ["g"]),
        helper.make_node("Mul", ["lr", "g"], ["step"]),
        helper.make_node("Sub", ["w", "step"], ["w_out"]),
        helper.make_node("Cast", ["w_out"], ["w_copy"], to=f),
        helper.make_node("MatMul", ["x", "w_out"], ["h"]),
        helper.make_node("Mul", ["lr", "h"], ["hs"]),
        helper.make_node("Sub", ["v", "hs"], ["v_out"]),
        helper.make_node("If", ["cond"], ["c_out"], then_branch=branch, else_branch=branch),
        helper.make_node("Add", ["c_out", "u"], ["u_out"]),
        helper.make_node("Mul", ["m", "b"], ["mb"]),
        helper.make_node("Add", ["mb", "g2"], ["b_out"]),
        helper.make_node("Sub", ["p", "b_out"], ["p_out"]),
        helper.make_node("Add", ["", "p"], ["q_out"]),
        helper.make_node("Mul", ["half", "u"], ["uh"]),
        helper.make_node("Add", ["uh", "p"], ["r_out"]),
        helper.make_node("Mul", ["half", "x"], ["xh"]),
        helper.make_node("Add", ["xh", "c"], ["t_out"]),
        # Two outputs, the second only listed in the first's region (an operand of its MatMul leaf).
        helper.make_node("MatMul", ["xj", "k_out"], ["jm"]),
        helper.make_node("Sub", ["j", "jm"], ["j_out"]),
        helper.make_node("Add", ["k", "kk"], ["k_out"]),
    ]
    # One-element updates reading the learning rate (read by more than SHARED_SCALAR_REGIONS regions).
    for k in range(classes.SHARED_SCALAR_REGIONS + 1):
        nodes.append(helper.make_node("Sub", [f"e{k}", "lr"], [f"e{k}_out"]))
    if max_walk:
        previous = "z"
        for k in range(classes.MAX_WALK + 2):
            nodes.append(helper.make_node("Neg", [previous], [f"z{k}"]))
            previous = f"z{k}"
        nodes.append(helper.make_node("Identity", [previous], ["z_out"]))
    inputs = [helper.make_tensor_value_info("g0", f, [8])]
    inputs += [helper.make_tensor_value_info(n, f, [4]) for n in ("w", "x", "v", "c", "u", "b", "g2", "p", "z", "j", "k", "kk")]
    inputs.append(helper.make_tensor_value_info("xj", f, [4, 4]))
    inputs += [helper.make_tensor_value_info(n, f, []) for n in ("lr", "m")]
    inputs += [helper.make_tensor_value_info(f"e{k}", f, []) for k in range(classes.SHARED_SCALAR_REGIONS + 1)]
    inputs.append(helper.make_tensor_value_info("cond", TensorProto.BOOL, []))
    outputs = [helper.make_tensor_value_info(n, f, None) for n in ("w_out", "w_copy", "v_out", "u_out", "b_out", "p_out", "q_out", "r_out", "t_out", "j_out", "k_out")]
    outputs += [helper.make_tensor_value_info(f"e{k}_out", f, None) for k in range(classes.SHARED_SCALAR_REGIONS + 1)]
    if max_walk:
        outputs.append(helper.make_tensor_value_info("z_out", f, None))
    graph = helper.make_graph(nodes, "hand", inputs, outputs, [helper.make_tensor("half", f, [], [0.5])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_hand_made_regions_walk_the_same_natively():
    model = _hand_made()
    index = build_index(model)
    walk = classes._walk_regions_python(classes._Walker(index), list(index.graph_outputs))
    # The graph has what the comparison is for (else it would pass on too little).
    assert walk.fringes["v_out"] and walk.regions["b_out"] is None and "u_out" in walk.direct
    assert any(len(index.nodes[k][3]) == 2 for k in range(len(index.nodes)))
    walker = classes._Walker(index)
    cluster_of, _, unlinked = classes._union_python(walker, list(index.graph_outputs), walk.appearances)
    assert {"lr", "half"} <= set(unlinked)  # a shared scalar (linking only one-element updates), a constant
    assert len({cluster_of[f"e{k}_out"] for k in range(classes.SHARED_SCALAR_REGIONS + 1)}) == 1
    assert cluster_of["w_out"] == cluster_of["v_out"] != cluster_of["e0_out"]
    assert "k_out" in walk.fringes["j_out"] and cluster_of["j_out"] == cluster_of["k_out"]
    _assert_same_walk(model)


def test_a_region_past_max_walk_raises_the_same_natively():
    model = _hand_made(max_walk=True)
    index = build_index(model, infer_shapes=False)
    walker = classes._Walker(index)
    with pytest.raises(classes._TooLarge):
        classes._walk_regions_python(walker, list(index.graph_outputs))
    _assert_same_walk(model)


def _keys(model: onnx.ModelProto) -> list:
    index = build_index(model)
    normaliser = Normaliser(index)
    outputs = [o for o in dict.fromkeys(index.graph_outputs) if index.spec(o).dtype in sgd_match._EPS]
    pins = RolePins()
    named_next = sgd_match._named_next(index, outputs, pins)
    name_facts = sgd_match.name_facts_of(index, pins, named_next)
    clusters = classes.clusters_of(index, outputs, name_facts, lambda o: set(normaliser.form(o)) - {ONE})
    return [(c.outputs, c.extras, c.values, c.nodes, c.key) for c in clusters]


@pytest.mark.parametrize("which", ["bench-1", "bench-60", "hand-made", *(str(p.relative_to(ROOT)) for p in MODELS)])
def test_clusters_and_keys_are_the_same_with_the_native_walk_off(which, monkeypatch):
    _native()
    if which.startswith("bench-"):
        model = _bench_model(int(which[6:]))
    else:
        model = _hand_made() if which == "hand-made" else onnx.load(ROOT / which)
    with_native = _keys(model)
    monkeypatch.setenv(NATIVE_ENV, "0")
    assert classes._native() is None
    assert _keys(model) == with_native

"""Lowering stays linear in the size of the graph: the reachability structure behind the ordering of state
access (``sgdfuse.lowering.dag.OpOrder``) against a brute-force walk on random graphs, and lowering work on
generated graphs of growing size (bench/generate.py)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
from graphs import bench_generator

import sgdfuse
from sgdfuse.lowering.dag import OpOrder
from sgdfuse.lowering.graph_builder import GraphBuilder
from test_lowering_support import run_both


def _random_builder(rng: random.Random, size: int) -> GraphBuilder:
    builder = GraphBuilder("random")
    for k in range(size):
        sources = rng.sample(range(k), min(k, rng.randrange(3)))
        builder.add("Op", f"op{k}", [(f"x{j}", builder.ops[f"op{s}"].output(0)) for j, s in enumerate(sources)], [("y", None)])  # type: ignore[list-item]
    return builder


def _reaches(succs: dict[str, set[str]], source: str, target: str) -> bool:
    seen, stack = {source}, [source]
    while stack:
        for other in succs[stack.pop()]:
            if other == target:
                return True
            if other not in seen:
                seen.add(other)
                stack.append(other)
    return False


@pytest.mark.parametrize("hub_after", [0, 256])
@pytest.mark.parametrize("seed", range(5))
def test_op_order_keeps_a_topological_rank_and_answers_reachability_like_a_full_walk(seed, hub_after):
    # hub_after=0: every path found makes a hub (up to the cap), so answers also come from hub sets that
    # were collected before later edges were added.
    rng = random.Random(seed)
    builder = _random_builder(rng, 60)
    order = OpOrder(builder, hub_after=hub_after)
    names = list(builder.ops)
    for _ in range(80):
        a, b = rng.sample(names, 2)
        assert order.reaches(a, b) == _reaches(order.succs, a, b)
        before, after = rng.sample(names, 2)
        if _reaches(order.succs, after, before):
            with pytest.raises(ValueError, match="cannot wait for it"):
                order.add_edge(before, after)
            continue
        order.add_edge(before, after)
        for name in list(order.rank):  # every op's predecessors (read from its record when first asked for)
            assert all(order.rank[s] < order.rank[name] for s in order.preds[name])
    for _ in range(200):
        a, b = rng.sample(names, 2)
        assert order.reaches(a, b) == _reaches(order.succs, a, b)
    if hub_after == 0:
        assert order._hubs


@pytest.mark.parametrize("seed", range(3))
def test_op_order_ranks_a_graph_whose_creation_order_is_not_topological(seed):
    # Control edges from later ops (what order_state_access and snapshots add) break creation order; the rank
    # is then sorted, and must still put every source first and answer reachability like a full walk.
    rng = random.Random(seed)
    builder = _random_builder(rng, 60)
    names = list(builder.ops)
    for _ in range(20):
        early, late = sorted(rng.sample(range(len(names)), 2))
        if not _reaches({n: set() for n in names} | _succs(builder), names[early], names[late]):
            builder.add_control(names[early], names[late])
    order = OpOrder(builder)
    for name in list(order.rank):
        assert all(order.rank[s] < order.rank[name] for s in order.preds[name])
    for _ in range(200):
        a, b = rng.sample(names, 2)
        assert order.reaches(a, b) == _reaches(order.succs, a, b)


def test_op_order_refuses_a_cycle_in_the_builder():
    builder = GraphBuilder("cycle")
    a = builder.add("Op", "a", outputs=[("y", None)])  # type: ignore[list-item]
    b = builder.add("Op", "b", [("x", a.output(0))], [("y", None)])  # type: ignore[list-item]
    builder.add_control(a.name, b.name)
    with pytest.raises(ValueError, match="cycle"):
        OpOrder(builder)


def _succs(builder: GraphBuilder) -> dict[str, set[str]]:
    succs: dict[str, set[str]] = {name: set() for name in builder.ops}
    for name in builder.ops:
        for source in builder.predecessors(name):
            succs[source].add(name)
    return succs


def _generate(size: int, directory: Path) -> Path:
    model, _ = bench_generator().build(size)
    path = directory / f"fused_{size}.onnx"
    sgdfuse.optimize(model, verify=False).save(path)
    return path


def _python_calls(function, *args, **kwargs) -> int:
    """How many Python function calls ``function(*args, **kwargs)`` makes (a count of the interpreter's work
    that, unlike seconds, does not depend on what else the machine runs)."""
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        if event == "call":
            calls += 1

    sys.setprofile(count)
    try:
        function(*args, **kwargs)
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.slow
def test_lowering_work_grows_linearly_with_the_number_of_updates(tmp_path):
    # 500 -> 2000 updates is 4x the graph: linear lowering does about 4x the work, the quadratic lowering
    # this replaced about 16x (1000 updates 15 s, 3000 updates 325 s). Work is counted in Python calls.
    calls = {size: _python_calls(sgdfuse.lower, _generate(size, tmp_path), soc="Ascend910B2") for size in (500, 2000)}
    assert calls[2000] < 6 * calls[500], calls


def deep_mlp(layers: int):
    """A training step of a ``layers``-deep MLP with its backward pass written out: the forward MatMul
    reading ``W_k`` reaches ``W_k``'s update only through the loss (a path as long as the network), and the
    backward ``Transpose(W_k)`` feeding the layers below must run before ``W_k`` is updated."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    f = TensorProto.FLOAT
    nodes, inputs, outputs = [], [helper.make_tensor_value_info("x", f, [2, 4])], [helper.make_tensor_value_info("loss", f, [])]
    initializers = [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in (("lr", 0.01), ("m", 0.9), ("zero", 0.0))]
    h = "x"
    for k in range(1, layers + 1):
        inputs += [helper.make_tensor_value_info(f"W{k}", f, [4, 4]), helper.make_tensor_value_info(f"buf{k}", f, [4, 4])]
        nodes += [helper.make_node("MatMul", [h, f"W{k}"], [f"z{k}"]), helper.make_node("Relu", [f"z{k}"], [f"h{k}"])]
        h = f"h{k}"
    nodes += [helper.make_node("ReduceSum", [h], ["loss"], keepdims=0), helper.make_node("Add", [h, "loss"], ["dh"])]
    dh = "dh"
    for k in range(layers, 0, -1):
        nodes += [
            helper.make_node("Greater", [f"z{k}", "zero"], [f"pos{k}"]),
            helper.make_node("Where", [f"pos{k}", dh, "zero"], [f"dz{k}"]),
            helper.make_node("Transpose", [f"h{k - 1}" if k > 1 else "x"], [f"hT{k}"], perm=[1, 0]),
            helper.make_node("MatMul", [f"hT{k}", f"dz{k}"], [f"g{k}"]),
            helper.make_node("Transpose", [f"W{k}"], [f"WT{k}"], perm=[1, 0], name=f"WT{k}"),
            helper.make_node("MatMul", [f"dz{k}", f"WT{k}"], [f"dh{k - 1}"]),
        ]
        dh = f"dh{k - 1}"
    for k in range(1, layers + 1):
        nodes += [
            helper.make_node("Mul", [f"buf{k}", "m"], [f"bm{k}"]),
            helper.make_node("Add", [f"bm{k}", f"g{k}"], [f"buf{k}_out"]),
            helper.make_node("Mul", [f"buf{k}_out", "lr"], [f"st{k}"]),
            helper.make_node("Sub", [f"W{k}", f"st{k}"], [f"W{k}_out"]),
        ]
        outputs += [helper.make_tensor_value_info(f"W{k}_out", f, [4, 4]), helper.make_tensor_value_info(f"buf{k}_out", f, [4, 4])]
    model = helper.make_model(helper.make_graph(nodes, "deep", inputs, outputs, initializers), opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return model


def test_in_a_deep_network_each_update_waits_only_for_the_backward_read_of_its_weight():
    layers = 40
    result = sgdfuse.optimize(deep_mlp(layers), verify=False)
    assert len(result.report.fused) == layers, result.report
    lowered = sgdfuse.lower(result.model, soc="Ascend910B2")
    for k in range(1, layers + 1):
        controls = [e for e in lowered.op(f"sgdfuse/W{k}_out/SGD").input if e.endswith(":-1")]
        assert controls == ([] if k == 1 else [f"WT{k}:-1"]), (k, controls)  # WT1's result is unused, so pruned
    small = sgdfuse.optimize(deep_mlp(8), verify=False).model
    run_both(small, sgdfuse.lower(small, soc="Ascend910B2"), steps=3)


class _CountingRanks(dict):
    """An op-rank table that counts its look-ups: every op a reachability walk visits is looked up here."""

    reads = 0

    def __getitem__(self, key):
        _CountingRanks.reads += 1
        return super().__getitem__(key)


@pytest.mark.slow
def test_lowering_a_deep_network_grows_linearly_with_its_depth(monkeypatch):
    # Every forward read of a weight reaches its update through the loss: answered by walks, that would be
    # quadratic in the depth; the hubs of OpOrder make it linear. Measured in ops visited (rank look-ups),
    # not in seconds: the count does not depend on the machine's load.
    original_init = OpOrder.__init__

    def counting_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.rank = _CountingRanks(self.rank)

    monkeypatch.setattr(OpOrder, "__init__", counting_init)
    visits = {}
    for layers in (200, 800):
        model = sgdfuse.optimize(deep_mlp(layers), verify=False).model
        _CountingRanks.reads = 0
        sgdfuse.lower(model, soc="Ascend910B2")
        visits[layers] = _CountingRanks.reads
    assert visits[200] > 0, "the lowering walks ranked ops"
    assert visits[800] < 8 * visits[200], visits  # 4x the depth: ~4x when linear, ~16x when quadratic


@pytest.mark.parametrize("seed", range(3))
def test_graph_order_is_creation_order_when_that_is_topological_and_a_topological_sort_otherwise(seed):
    rng = random.Random(seed)
    builder = _random_builder(rng, 40)
    assert [r.name for r in builder._order()] == list(builder.ops)
    order = OpOrder(builder)
    names = list(builder.ops)
    for _ in range(30):  # control edges against creation order, where they close no cycle
        before, after = rng.sample(names, 2)
        if builder.ops[before].position > builder.ops[after].position and not order.reaches(after, before):
            order.add_edge(before, after)
            builder.add_control(after, before)
    written = [r.name for r in builder._order()]
    assert sorted(written) == sorted(names) and written != names
    place = {name: k for k, name in enumerate(written)}
    assert all(place[p] < place[name] for name in names for p in builder.predecessors(name))

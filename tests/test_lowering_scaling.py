"""Lowering stays linear in the size of the graph: the reachability structure behind the ordering of state
access (``sgdfuse.lowering.dag.OpOrder``) against a brute-force walk on random graphs, and lowering time on
generated graphs of growing size (bench/generate.py)."""

from __future__ import annotations

import importlib.util
import random
import time
from pathlib import Path

import pytest

import sgdfuse
from sgdfuse.lowering.dag import OpOrder
from sgdfuse.lowering.graph_builder import GraphBuilder


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


@pytest.mark.parametrize("seed", range(5))
def test_op_order_keeps_a_topological_rank_and_answers_reachability_like_a_full_walk(seed):
    rng = random.Random(seed)
    builder = _random_builder(rng, 60)
    order = OpOrder(builder)
    names = list(builder.ops)
    for _ in range(80):
        before, after = rng.sample(names, 2)
        if _reaches(order.succs, after, before):
            with pytest.raises(ValueError, match="cannot wait for it"):
                order.add_edge(before, after)
            continue
        order.add_edge(before, after)
        for name, sources in order.preds.items():
            assert all(order.rank[s] < order.rank[name] for s in sources)
    for _ in range(200):
        a, b = rng.sample(names, 2)
        assert order.reaches(a, b) == _reaches(order.succs, a, b)
        floor = rng.randrange(len(names))
        expected = {n for n in names if n != a and order.rank[n] >= floor and _reaches(order.succs, n, a)}
        assert order.ancestors_from(a, floor) == expected


def _generate(size: int, directory: Path) -> Path:
    spec = importlib.util.spec_from_file_location("bench_generate", Path(__file__).resolve().parent.parent / "bench" / "generate.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    model, _ = module.build(size)
    path = directory / f"fused_{size}.onnx"
    sgdfuse.optimize(model, verify=False).save(path)
    return path


@pytest.mark.slow
def test_lowering_time_grows_linearly_with_the_number_of_updates(tmp_path):
    # 500 -> 2000 updates is 4x the graph: linear lowering takes about 4x as long, the quadratic lowering
    # this replaces took about 16x (1000 updates 15 s, 3000 updates 325 s). The bound leaves room for noise.
    seconds = {}
    for size in (500, 2000):
        path = _generate(size, tmp_path)
        runs = []
        for _ in range(2):
            start = time.perf_counter()
            sgdfuse.lower(path, soc="Ascend910B2")
            runs.append(time.perf_counter() - start)
        seconds[size] = min(runs)
    assert seconds[2000] < 8 * seconds[500], seconds

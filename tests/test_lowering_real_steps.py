"""Whole PyTorch training steps (testdata/steps: CNN with BatchNorm, tiny GPT, clipped CNN, loss-scaled MLP,
small ResNet-18) lowered to GE on every product line, run in the GE executor against onnxruntime over three
chained in-place steps, and the order of reads around the in-place SGD writes in the lowered graphs."""

from __future__ import annotations

from collections import deque

import pytest

import sgdfuse
from sgdfuse.fused_op import is_sgd_node
from sgdfuse.lowering.state import ALIAS_OP_TYPES
from steps_support import ENTRIES, STEP_NAMES, fused_step, run_chained
from test_lowering_support import SOC_PER_LINE

FAST = [name for name in STEP_NAMES if not name.startswith("resnet")]
SLOW = [pytest.param(name, marks=pytest.mark.slow) for name in STEP_NAMES if name.startswith("resnet")]


def test_the_corpus_holds_the_five_whole_steps():
    assert STEP_NAMES == ["cnn_bn", "cnn_clip", "cnn_frozen", "gpt_tiny", "mlp_amp", "resnet_small"]
    assert {"Conv", "BatchNormalization", "MaxPool", "AveragePool"} <= set(ENTRIES["cnn_frozen"]["op_types"])
    resnet = ENTRIES["resnet_small"]
    # 20 convolutions; every one but the stem (whose input needs no gradient) has a Col2Im in the backward.
    assert resnet["op_types"]["Col2Im"] == 19 and resnet["op_types"]["MaxPool"] >= 1


@pytest.mark.parametrize("line", list(SOC_PER_LINE))
@pytest.mark.parametrize("name", FAST + SLOW)
def test_every_step_lowers_with_one_ge_sgd_per_fused_update(name, line):
    # FLOAT throughout and static shapes: every product line accepts these steps.
    model = fused_step(name)
    lowered = sgdfuse.lower(model, soc=SOC_PER_LINE[line])
    fused = [node for node in model.graph.node if is_sgd_node(node)]
    assert [op.type for op in lowered.graph.op].count("SGD") == len(fused) == len(lowered.sgd_ops)
    assert lowered.outputs == [o.name for o in model.graph.output]


@pytest.mark.parametrize("name", ["cnn_bn", "cnn_frozen", "gpt_tiny", "resnet_small"])
def test_the_plain_momentum_steps_fuse_every_update(name):
    fused = [node for node in fused_step(name).graph.node if is_sgd_node(node)]
    assert len(fused) == ENTRIES[name]["expected_momentum_updates"]


@pytest.mark.parametrize("name", FAST + SLOW)
def test_executor_agrees_with_onnxruntime_over_three_chained_steps(name):
    lowered = sgdfuse.lower(fused_step(name), soc="Ascend910B2")
    report = run_chained(name, lowered, steps=3)
    assert len(report) == 3 and set(report[0]) == set(lowered.outputs)


# ---- order of reads around the in-place writes --------------------------------------------------------------


def _reach(start: str, edges: dict[str, list[str]]) -> set[str]:
    seen: set[str] = set()
    queue = deque([start])
    while queue:
        for other in edges.get(queue.popleft(), ()):
            if other not in seen:
                seen.add(other)
                queue.append(other)
    return seen


def _readers_of(graph, source: str) -> list[str]:
    """Ops reading ``source``'s output 0 by a data edge, directly or through ops that may alias it."""
    readers: dict[str, list[str]] = {}
    types = {op.name: op.type for op in graph.op}
    for op in graph.op:
        for entry in op.input:
            if not entry.endswith(":-1"):
                readers.setdefault(entry, []).append(op.name)
    found, queue = [], deque([source])
    while queue:
        for reader in readers.get(f"{queue.popleft()}:0", ()):
            found.append(reader)
            if types[reader] in ALIAS_OP_TYPES:
                queue.append(reader)
    return found


@pytest.mark.slow
def test_resnet_reads_of_old_state_precede_each_sgd_write_and_reads_of_new_values_follow():
    lowered = sgdfuse.lower(fused_step("resnet_small"), soc="Ascend910B2")
    graph = lowered.graph
    before: dict[str, list[str]] = {}
    after: dict[str, list[str]] = {}
    for op in graph.op:
        for entry in op.input:
            source = entry.rsplit(":", 1)[0]
            before.setdefault(op.name, []).append(source)
            after.setdefault(source, []).append(op.name)
    ops = {op.name: op for op in graph.op}
    several_readers = 0
    for name in lowered.sgd_ops:
        sgd = ops[name]
        earlier, later = _reach(name, before), _reach(name, after)
        for port in (0, 3):  # parameters, accum: variables written in place
            variable = sgd.input[port].rsplit(":", 1)[0]
            assert ops[variable].type == "Variable"
            readers = [r for r in _readers_of(graph, variable) if r != name]
            old_readers = [r for r in readers if not r.startswith("sgdfuse/")]  # the forward and backward passes
            several_readers += port == 0 and len(old_readers) >= 2
            assert not [r for r in old_readers if r not in earlier], f"{variable}: read by the step but not ordered before {name}"
            assert not [r for r in readers if r not in earlier and r not in later], f"{variable}: a read unordered with {name}"
        assert not [r for r in _readers_of(graph, name) if r not in later]  # the new value: after the write
    assert several_readers >= 10  # weights read by several nodes (forward conv, its backward, weight decay)


@pytest.mark.parametrize("name", FAST + SLOW)
def test_sgdfuse_lower_writes_every_real_step_after_its_own_in_place_check(name, tmp_path):
    # What a user runs: the CLI optimises, lowers, and verifies the GE graph in place against onnxruntime
    # before writing (an ill-conditioned step, like the ResNet's BatchNorms, must still pass that check).
    import subprocess
    import sys
    from pathlib import Path

    model = Path(__file__).resolve().parent.parent / "testdata" / "steps" / f"{name}.onnx"
    done = subprocess.run(
        [sys.executable, "-m", "sgdfuse.cli", "lower", str(model), "--soc", "Ascend910B2", "-o", str(tmp_path / "step.air")],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr
    assert (tmp_path / "step.air").stat().st_size > 0

"""The index's tables built natively (sgdfuse.passes.value_scan.add_specs and sweep_nodes) against the Python
loops they replace, and shape inference run in a forked child (index._ForkedInference) against inference run
in-process: the same dictionaries, in the same order, and every failure of the child falls back to in-process
inference with its warnings."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from sgdfuse.contract import TensorSpec
from sgdfuse.errors import GraphCycleError
from sgdfuse.passes import index as index_module
from sgdfuse.passes import value_scan
from sgdfuse.passes.value_scan import INPUT, native_available, scan_value_infos

TESTDATA = Path(__file__).resolve().parent.parent / "testdata"
MODELS = sorted(TESTDATA.rglob("*.onnx"))


@pytest.fixture(autouse=True, scope="module")
def _scanner_builds() -> None:
    # Fail, not skip, when the scanner cannot be built (as tests/test_index_value_scan.py).
    scan_value_infos(helper.make_model(helper.make_graph([], "empty", [], [])).SerializeToString(), INPUT)
    assert native_available(), "SGDFUSE_NATIVE_SCAN=0 turns the scanner these tests check off"


def _python_add_specs(specs, names, type_ids, found_of) -> None:
    """The rule of index._add_scanned_specs, written out here (not the code under test)."""
    for name, type_id in zip(names, type_ids):
        known = specs.get(name)
        if known is not None and known.shape is not None:
            continue
        found = found_of[type_id]
        if found is not None:
            specs[name] = TensorSpec(name, found[0], found[1])


def _exact(specs: dict) -> list:
    """A dict of specs as what could differ: order, key and field values and their types."""
    return [(k, type(k), type(v), v.name, v.shape, type(v.shape), v.dtype, type(v.dtype)) for k, v in specs.items()]


def test_add_specs_keeps_a_shaped_spec_replaces_a_shapeless_one_and_skips_non_tensors() -> None:
    found_of = [((2, "N", None), TensorProto.FLOAT), None, (None, TensorProto.INT64), ((), TensorProto.BOOL)]
    names = ["a", "b", "c", "d", "e", "a", "c", "f", "f"]
    type_ids = [0, 1, 2, 3, 0, 3, 0, 2, 0]
    start = {"b": TensorSpec("b", None, 7), "d": TensorSpec("d", (5,), 1), "z": TensorSpec("z", (1,), 1)}
    expected, native = dict(start), dict(start)
    _python_add_specs(expected, names, type_ids, found_of)
    value_scan.add_specs(native, names, type_ids, found_of, TensorSpec)
    assert _exact(native) == _exact(expected)
    # Independently of the loop above: a's first (shaped) spec stays, c's shapeless one is replaced once,
    # f's shapeless then shaped; d keeps its declared (5,); b finds a non-tensor type and keeps its own.
    assert native["a"] == TensorSpec("a", (2, "N", None), TensorProto.FLOAT)
    assert native["c"] == TensorSpec("c", (2, "N", None), TensorProto.FLOAT)
    assert native["f"] == TensorSpec("f", (2, "N", None), TensorProto.FLOAT)
    assert native["d"] == TensorSpec("d", (5,), 1) and native["b"] == TensorSpec("b", None, 7)
    assert list(native) == ["b", "d", "z", "a", "c", "e", "f"]
    assert hash(native["a"]) == hash(TensorSpec("a", (2, "N", None), TensorProto.FLOAT))


def test_add_specs_reads_the_shape_of_another_kind_of_spec_and_refuses_bad_arguments() -> None:
    class Other:
        def __init__(self, shape):
            self.shape = shape

    specs = {"a": Other((1,)), "b": Other(None)}
    value_scan.add_specs(specs, ["a", "b"], [0, 0], [((3,), 1)], TensorSpec)
    assert isinstance(specs["a"], Other) and specs["b"] == TensorSpec("b", (3,), 1)
    with pytest.raises(TypeError):
        value_scan.add_specs({}, ["a"], [0], [((3,), 1)], Other)  # no slots name, shape, dtype
    with pytest.raises(TypeError):
        value_scan.add_specs({}, ["a"], [0], [[(3,), 1]], TensorSpec)  # a list, not a pair
    with pytest.raises(IndexError):
        value_scan.add_specs({}, ["a"], [1], [((3,), 1)], TensorSpec)
    with pytest.raises(ValueError):
        value_scan.add_specs({}, ["a", "b"], [0], [((3,), 1)], TensorSpec)


def test_sweep_nodes_equals_the_python_loop_on_names_empty_repeated_and_not_text() -> None:
    nodes = [
        ("A", "", ("x", "", "x"), ("y", ""), False, False),
        ("B", "", ("y", "w"), ("z",), True, True),
        ("C", "", (), ("y", b"\xff"), False, False),  # y output twice; a name protobuf gave as bytes
        ("D", "", (b"\xff", "z", "y"), (), True, False),
    ]
    native = value_scan.sweep_nodes(nodes)
    python = index_module._sweep_python(nodes)
    assert [list(t.items()) if isinstance(t, dict) else t for t in native[:4]] == [list(t.items()) if isinstance(t, dict) else t for t in python]
    producer, consumers, holders, defined, text = native
    assert list(producer.items()) == [("y", 2), ("z", 1), (b"\xff", 2)]
    assert list(consumers.items()) == [("x", [0, 0]), ("y", [1, 3]), ("w", [1]), (b"\xff", [3]), ("z", [3])]
    assert holders == [1, 3] and defined == 4 and text is False
    assert value_scan.sweep_nodes(nodes[:2])[4] is True  # names, op types and domains all str
    assert value_scan.sweep_nodes([("A", b"\xff", (), (), False, False)])[4] is False  # a domain in other bytes
    assert value_scan.sweep_nodes([(b"\xff", "", (), (), False, False)])[4] is False
    assert value_scan.sweep_nodes([("A", "", (b"",), (), False, False)])[4] is True  # empty names are not read
    with pytest.raises(TypeError):
        value_scan.sweep_nodes([("A", "", ["x"], ("y",), False, False)])


@pytest.mark.parametrize("path", MODELS, ids=lambda p: str(p.relative_to(TESTDATA)))
def test_index_tables_equal_the_python_loops_in_order(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = onnx.load(path, load_external_data=False)
    native = index_module.build_index(model)
    monkeypatch.setattr(value_scan, "add_specs", lambda specs, names, ids, found_of, _: _python_add_specs(specs, names, ids, found_of))
    monkeypatch.setattr(value_scan, "sweep_nodes", lambda nodes: (*index_module._sweep_python(nodes), None))
    python = index_module.build_index(model)
    assert _exact(native.specs) == _exact(python.specs)
    assert list(native.producer.items()) == list(python.producer.items())
    assert list(native.consumers.items()) == list(python.consumers.items())
    assert (native.subgraph_nodes, native.subgraph_reads) == (python.subgraph_nodes, python.subgraph_reads)


# --- shape inference in a forked child ---------------------------------------------------------------------


def _chain(count: int, *, declared: bool = False, reshape: bool = False) -> onnx.ModelProto:
    """x (N, 3) -> Relu -> ... count nodes -> Mul by a constant (1, 3) -> y, the shapes inference gives
    depending on the symbolic N; with ``reshape``, a Reshape by the chain's own Shape before the Mul (which only
    data propagation types)."""
    nodes, name = [], "x"
    for k in range(count):
        nodes.append(helper.make_node("Relu", [name], [f"r{k}"]))
        name = f"r{k}"
    if reshape:
        nodes += [helper.make_node("Shape", [name], ["s"]), helper.make_node("Reshape", [name, "s"], ["y0"])]
        name = "y0"
    nodes.append(helper.make_node("Mul", [name, "c"], ["y"]))
    c = helper.make_tensor("c", TensorProto.FLOAT, [1, 3], [1.0, 2.0, 3.0])
    infos = [helper.make_tensor_value_info(f"r{k}", TensorProto.FLOAT, ["N", 3]) for k in range(count)] if declared else []
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [c], value_info=infos)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Calls of in-process inference (index._inferred_value_infos) are recorded."""
    calls: list[int] = []
    real = index_module._inferred_value_infos
    monkeypatch.setattr(index_module, "_inferred_value_infos", lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs))
    return calls


def _in_process(model: onnx.ModelProto, monkeypatch: pytest.MonkeyPatch) -> index_module.GraphIndex:
    with monkeypatch.context() as patch:
        patch.setattr(index_module._ForkedInference, "start", classmethod(lambda cls, *args: None))
        return index_module.build_index(model)


@pytest.fixture
def forks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every graph forks; the children's pids are recorded."""
    monkeypatch.setattr(index_module, "FORK_MIN_NODES", 0)
    pids: list[int] = []
    real = index_module._ForkedInference.__init__

    def init(self, pid, reader):
        pids.append(pid)
        real(self, pid, reader)

    monkeypatch.setattr(index_module._ForkedInference, "__init__", init)
    return pids


def _reaped(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


@pytest.mark.parametrize("path", MODELS, ids=lambda p: str(p.relative_to(TESTDATA)))
def test_forked_inference_gives_the_specs_of_in_process_inference(path: Path, forks, monkeypatch: pytest.MonkeyPatch) -> None:
    model = onnx.load(path, load_external_data=False)
    forked = index_module.build_index(model)
    assert _exact(forked.specs) == _exact(_in_process(model, monkeypatch).specs)
    assert all(_reaped(pid) for pid in forks)


def test_forked_inference_types_a_symbolic_chain_as_in_process(forks, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _chain(50)
    expected = _exact(_in_process(model, monkeypatch).specs)
    calls = _counted(monkeypatch)
    forked = index_module.build_index(model)
    assert len(forks) == 1 and _reaped(forks[0]) and calls == []  # the child's result taken
    assert _exact(forked.specs) == expected
    assert forked.specs["y"] == TensorSpec("y", ("N", 3), TensorProto.FLOAT)  # independently: Mul broadcast of (N, 3) and (1, 3)
    assert forked.specs["r49"] == TensorSpec("r49", ("N", 3), TensorProto.FLOAT)


def test_a_graph_needing_data_propagation_or_with_a_subgraph_is_inferred_in_process(forks, monkeypatch: pytest.MonkeyPatch) -> None:
    # The child runs inference without data propagation, so its result is not the one wanted here.
    model = _chain(20, reshape=True)
    expected = _exact(_in_process(model, monkeypatch).specs)
    calls = _counted(monkeypatch)
    forked = index_module.build_index(model)
    assert _exact(forked.specs) == expected and calls == [1] and len(forks) == 1 and _reaped(forks[0])
    assert forked.specs["y"] == TensorSpec("y", ("N", 3), TensorProto.FLOAT)  # Reshape by the chain's own shape
    # A subgraph: its value infos are parsed from the whole inferred model, in-process.
    branch = helper.make_graph([helper.make_node("Relu", ["r19"], ["b"])], "branch", [], [helper.make_tensor_value_info("b", TensorProto.FLOAT, None)])
    model = _chain(20)
    model.graph.node.append(helper.make_node("If", ["cond"], ["z"], then_branch=branch, else_branch=branch))
    model.graph.input.append(helper.make_tensor_value_info("cond", TensorProto.BOOL, []))
    expected = _exact(_in_process(model, monkeypatch).specs)
    calls.clear()
    assert _exact(index_module.build_index(model).specs) == expected and calls == [1] and len(forks) == 2 and _reaped(forks[1])


@pytest.mark.parametrize("failure", ["exit", "killed", "refused", "parent raises"])
def test_a_failed_child_falls_back_to_in_process_inference(failure: str, forks, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _chain(20)
    expected = _exact(_in_process(model, monkeypatch).specs)
    if failure == "exit":
        monkeypatch.setattr(index_module, "_infer_to", lambda *args: 3)
    elif failure == "killed":
        monkeypatch.setattr(index_module, "_infer_to", lambda *args: os.kill(os.getpid(), signal.SIGKILL))
    elif failure == "parent raises":
        monkeypatch.setattr(index_module, "_needs_data_propagation", lambda *args: 1 / 0)
        with pytest.raises(ZeroDivisionError):  # as before: the parent's own call raises it
            index_module.build_index(model)
        assert len(forks) == 1 and _reaped(forks[0])
        return
    else:
        monkeypatch.setattr(index_module, "_inference_input", lambda model, data: (model.SerializeToString(), ValueError("no")))
    calls = _counted(monkeypatch)
    assert _exact(index_module.build_index(model).specs) == expected
    assert calls == [1] and len(forks) == 1 and _reaped(forks[0])


def test_inference_failing_in_the_child_warns_once_as_in_process(forks, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    model = _chain(20)
    monkeypatch.setattr(onnx.shape_inference.C, "infer_shapes", lambda *args: (_ for _ in ()).throw(RuntimeError("boom")))
    with caplog.at_level(logging.WARNING, logger=index_module.__name__):
        forked = index_module.build_index(model)
    assert [r.getMessage() for r in caplog.records] == ["shape inference failed, continuing with declared shapes only: boom"]
    assert forked.spec("r0").shape is None and forked.specs["x"] == TensorSpec("x", ("N", 3), TensorProto.FLOAT)
    assert len(forks) == 1 and _reaped(forks[0])


def test_the_child_is_stopped_and_reaped_when_its_result_is_not_wanted(forks, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every value declared: inference adds nothing and is not read (tests/test_index_inference_skip.py).
    declared = _chain(20, declared=True)
    declared.graph.output[0].CopyFrom(helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3]))
    index_module.build_index(declared)
    assert len(forks) == 1 and _reaped(forks[0])
    # The graph refused after the fork (a cycle): the child is reaped before the error leaves.
    cyclic = _chain(3)
    cyclic.graph.node[0].input[0] = "r2"
    with pytest.raises(GraphCycleError):
        index_module.build_index(cyclic)
    assert len(forks) == 2 and _reaped(forks[1])


def test_no_fork_for_small_graphs_other_threads_or_a_failed_fork(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _chain(20)
    expected = _exact(_in_process(model, monkeypatch).specs)
    forked = []
    real_fork = os.fork
    monkeypatch.setattr(os, "fork", lambda: forked.append(1) or real_fork())
    assert _exact(index_module.build_index(model).specs) == expected and forked == []  # 23 nodes < FORK_MIN_NODES
    monkeypatch.setattr(index_module, "FORK_MIN_NODES", 0)
    monkeypatch.setenv(index_module.FORK_ENV, "0")
    assert _exact(index_module.build_index(model).specs) == expected and forked == []
    monkeypatch.delenv(index_module.FORK_ENV)
    # A Python thread running (here: sleeping in its own code) forbids the fork; one waiting in threading
    # (as the CLI's progress display does) does not.
    stop = threading.Event()
    busy = threading.Thread(target=lambda: [time.sleep(0.001) for _ in iter(stop.is_set, True)], daemon=True)
    busy.start()
    try:
        assert _exact(index_module.build_index(model).specs) == expected and forked == []
    finally:
        stop.set()
        busy.join()
    stop.clear()
    parked = threading.Thread(target=stop.wait, daemon=True)
    parked.start()
    try:
        while not any(f.f_code is threading.Condition.wait.__code__ for i, f in sys._current_frames().items() if i == parked.ident):
            time.sleep(0.001)
        assert _exact(index_module.build_index(model).specs) == expected and forked == [1]
    finally:
        stop.set()
        parked.join()

    def refuse():
        raise OSError("no fork here")

    monkeypatch.setattr(os, "fork", refuse)
    assert _exact(index_module.build_index(model).specs) == expected

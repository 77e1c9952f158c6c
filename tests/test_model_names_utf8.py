"""A model whose names are not valid UTF-8 gets one clear error from every command, naming the file, what
carries the name and what to do — never an internal error.

ONNX names are protobuf ``string`` fields (onnx/onnx.proto), UTF-8 text; protobuf's Python API hands a field
holding other bytes out as ``bytes``, which equals no other name, and onnxruntime fails to decode it. Found
by a fresh trial: a gradient input named ``b"\\xff\\xfe..."`` made ``optimize``, ``inspect``, ``lower`` and
``check`` stop with "internal error: TypeError: intern() argument must be str, not bytes".
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

import sgdfuse
from sgdfuse.cli import main

BAD = b"\xff\xfe_grad"


def _update_model() -> onnx.ModelProto:
    """One plain momentum-SGD update: buf_out = 0.9*buf + GRAD, p_out = p - 0.1*buf_out (FLOAT, [4, 3])."""
    shape = [4, 3]
    nodes = [
        helper.make_node("Mul", ["buf", "m"], ["bm"], name="mul_m"),
        helper.make_node("Add", ["bm", "GRADNAME"], ["buf_out"], name="add_g"),
        helper.make_node("Mul", ["buf_out", "lr"], ["step"], name="mul_lr"),
        helper.make_node("Sub", ["p", "step"], ["p_out"], name="sub_step"),
    ]
    graph = helper.make_graph(
        nodes, "step",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in ("p", "GRADNAME", "buf")],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in ("p_out", "buf_out")],
        [helper.make_tensor("m", TensorProto.FLOAT, [], [0.9]), helper.make_tensor("lr", TensorProto.FLOAT, [], [0.1])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _with_bytes(model: onnx.ModelProto, placeholder: bytes, path: Path) -> Path:
    """``model`` written to ``path`` with every ``placeholder`` in its bytes replaced by :data:`BAD` (a name
    that is not UTF-8 cannot be set through the Python API)."""
    data = model.SerializeToString()
    assert placeholder in data
    path.write_bytes(data.replace(placeholder, BAD[: len(placeholder)].ljust(len(placeholder), b"_")))
    return path


def _run(argv: list) -> tuple[int, str]:
    err = io.StringIO()
    code = 0
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            main([str(a) for a in argv])
        except SystemExit as exited:
            code = exited.code if isinstance(exited.code, int) else 1
    return code, err.getvalue()


@pytest.fixture
def bad_value_name(tmp_path) -> Path:
    return _with_bytes(_update_model(), b"GRADNAME", tmp_path / "bad_value.onnx")


@pytest.mark.parametrize("command", ["optimize", "inspect", "lower", "check"])
def test_a_value_name_that_is_not_utf8_is_one_error_naming_the_file_and_the_node(command, bad_value_name, tmp_path):
    argv = {
        "optimize": ["optimize", bad_value_name, "-o", tmp_path / "out.onnx"],
        "inspect": ["inspect", bad_value_name],
        "lower": ["lower", bad_value_name, "--soc", "Ascend910B2", "-o", tmp_path / "out.air"],
        "check": ["check", bad_value_name, bad_value_name],
    }[command]
    code, err = _run(argv)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 1
    assert len(lines) == 1 and lines[0].startswith(f"error: {bad_value_name}: "), err
    assert "not valid UTF-8" in lines[0] and "internal error" not in lines[0]
    assert "node add_g" in lines[0] or "graph input" in lines[0]
    assert not (tmp_path / "out.onnx").exists() and not (tmp_path / "out.air").exists()


def _bad_node_name_model(tmp_path) -> Path:
    model = _update_model()
    # A node outside the update (the rewrite would keep it): a copy of the weights, returned as an output.
    model.graph.node.append(helper.make_node("Identity", ["p"], ["p_copy"], name="NODENAME"))
    model.graph.output.append(helper.make_tensor_value_info("p_copy", TensorProto.FLOAT, [4, 3]))
    return _with_bytes(model, b"NODENAME", tmp_path / "bad_node.onnx")


def test_a_node_name_that_is_not_utf8_is_refused_by_every_command_with_one_error(tmp_path):
    # A node's name becomes a GE op's name and onnxruntime decodes it: check and lower refused it, optimize
    # and inspect accepted it and wrote a model the other two refuse. Now all four say the same: the node by
    # its position (#4, the fifth node) and op type, the bytes, and what to do.
    path = _bad_node_name_model(tmp_path)
    want = f"error: {path}: the name of node #4 (Identity) (b'\\xff\\xfe_grad_') is not valid UTF-8"
    for argv in (["optimize", path, "-o", tmp_path / "out.onnx", "--report", tmp_path / "r.json"], ["inspect", path],
                 ["lower", path, "--soc", "Ascend910B2", "-o", tmp_path / "out.air"], ["check", path, path]):
        code, err = _run(argv)
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 1 and len(lines) == 1 and lines[0].startswith(want), (argv, err)
        assert "rename it in the exporter or with onnx's Python API" in lines[0], err
    assert not any((tmp_path / name).exists() for name in ("out.onnx", "r.json", "out.air", "out.init.air"))


def test_the_library_api_refuses_a_node_name_that_is_not_utf8(tmp_path):
    from sgdfuse.errors import ModelNameError

    path = _bad_node_name_model(tmp_path)
    model = onnx.load(path)
    for call in (sgdfuse.optimize, sgdfuse.inspect):
        with pytest.raises(ModelNameError) as raised:
            call(model)
        assert raised.value.where == "the name of node #4 (Identity)" and raised.value.name == b"\xff\xfe_grad_"
        with pytest.raises(ModelNameError, match=r"bad_node\.onnx: the name of node #4 \(Identity\)"):
            call(path)


@pytest.mark.parametrize("field", ["producer_name", "op_type", "attribute_name"])
def test_other_model_strings_that_are_not_utf8_are_one_error_too(field, tmp_path):
    # A producer name the rewrite copies into its output, an op type the checker and lowering read, an
    # attribute name onnxruntime decodes: each stopped a command with an internal error, onnxruntime's own
    # lines, or wrote an invalid model (a fresh trial's finding).
    model = _update_model()
    if field == "producer_name":
        model.producer_name = "PRODUCER"
        placeholder = b"PRODUCER"
    elif field == "op_type":
        model.graph.node.append(helper.make_node("Relu", ["p"], ["p_relu"], name="relu"))
        model.graph.output.append(helper.make_tensor_value_info("p_relu", TensorProto.FLOAT, [4, 3]))
        placeholder = b"Relu"
    else:  # an attribute of a node outside the update, which the rewrite keeps
        model.graph.node.append(helper.make_node("LeakyRelu", ["p"], ["p_leaky"], name="leaky", alpha=0.1))
        model.graph.output.append(helper.make_tensor_value_info("p_leaky", TensorProto.FLOAT, [4, 3]))
        placeholder = b"alpha"
    path = _with_bytes(model, placeholder, tmp_path / "bad.onnx")
    # Every command refuses it the same way: optimize and inspect too (an attribute name outside the updates
    # was copied into optimize's output, which check and lower then refused).
    commands = [["lower", path, "--soc", "Ascend910B2", "-o", tmp_path / "out.air"], ["check", path, path],
                ["optimize", path, "-o", tmp_path / "out.onnx"], ["inspect", path]]
    for argv in commands:
        code, err = _run(argv)
        assert code == 1 and err.startswith(f"error: {path}: ") and "not valid UTF-8" in err, (argv, err)
        if field == "attribute_name":
            assert err.startswith(f"error: {path}: an attribute of node #4 (LeakyRelu) (b'\\xff\\xfe_gr')"), (argv, err)
        assert not (tmp_path / "out.onnx").exists() and not (tmp_path / "out.air").exists()


# Names inside nested graphs: an If branch, a Loop body inside one, a model-local function's body. The scanner
# read the main graph only, so such a name passed optimize, inspect and check (and optimize wrote it into its
# output), and lower stopped with an internal error (a helper's finding); every command now refuses it.

def _branch(nodes: list, output: str, name: str) -> onnx.GraphProto:
    return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(output, TensorProto.FLOAT, [4, 3])])


def _loop_body() -> onnx.GraphProto:
    """A Loop body carrying ``x`` through one Identity (the node NESTNODE), iteration count and condition as usual."""
    return helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]), helper.make_node("Identity", ["x_in"], ["x_out"], name="NESTNODE")],
        "body",
        [helper.make_tensor_value_info("iter", TensorProto.INT64, []), helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("x_in", TensorProto.FLOAT, [4, 3])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), helper.make_tensor_value_info("x_out", TensorProto.FLOAT, [4, 3])],
    )


# place -> (the then branch's nodes and output, the placeholder replaced by BAD, what the error says carries it)
_NESTED = {
    "node name": ([helper.make_node("Identity", ["p"], ["t_out"], name="NESTNODE")], "t_out", b"NESTNODE",
                  "the name of node #0 (Identity) in the then_branch of node #4 (If)"),
    "attribute name": ([helper.make_node("LeakyRelu", ["p"], ["t_out"], name="leaky", alpha=0.1)], "t_out", b"alpha",
                       "an attribute of node #0 (LeakyRelu) in the then_branch of node #4 (If)"),
    "value name": ([helper.make_node("Neg", ["p"], ["NESTVALU"]), helper.make_node("Neg", ["NESTVALU"], ["t_out"])], "t_out", b"NESTVALU",
                   "an output of node #0 (Neg) in the then_branch of node #4 (If)"),
    "branch output": ([helper.make_node("Neg", ["p"], ["NESTOUTP"])], "NESTOUTP", b"NESTOUTP",
                      "a graph output of the then_branch of node #4 (If)"),
    "loop body inside a branch": (
        [helper.make_node("Constant", [], ["trip"], value=helper.make_tensor("trip", TensorProto.INT64, [], [1])),
         helper.make_node("Constant", [], ["go"], value=helper.make_tensor("go", TensorProto.BOOL, [], [True])),
         helper.make_node("Loop", ["trip", "go", "p"], ["t_out"], name="loop", body=_loop_body())],
        "t_out", b"NESTNODE", "the name of node #1 (Identity) in the body of node #2 (Loop) in the then_branch of node #4 (If)"),
}


def _nested_model(place: str) -> onnx.ModelProto:
    """:func:`_update_model` plus ``p_if = If(cond, then: the place's nodes, else: Identity(p))``, an output: the
    update fuses, the If is kept as it is. Valid ONNX (full check) before the placeholder is replaced."""
    nodes, output, _, _ = _NESTED[place]
    model = _update_model()
    model.graph.input.append(helper.make_tensor_value_info("cond", TensorProto.BOOL, []))
    then = _branch(nodes, output, "then")
    other = _branch([helper.make_node("Identity", ["p"], ["e_out"])], "e_out", "else")
    model.graph.node.append(helper.make_node("If", ["cond"], ["p_if"], name="branch", then_branch=then, else_branch=other))
    model.graph.output.append(helper.make_tensor_value_info("p_if", TensorProto.FLOAT, [4, 3]))
    onnx.checker.check_model(model, full_check=True)
    return model


def _function_model() -> onnx.ModelProto:
    """:func:`_update_model` plus ``p_neg = local.Negate(p)``, a model-local function whose body node is NESTNODE."""
    model = _update_model()
    body = [helper.make_node("Neg", ["x"], ["y"], name="NESTNODE")]
    model.functions.append(helper.make_function("local", "Negate", ["x"], ["y"], body, [helper.make_opsetid("", 17)]))
    model.opset_import.append(helper.make_opsetid("local", 1))
    model.graph.node.append(helper.make_node("Negate", ["p"], ["p_neg"], name="negate", domain="local"))
    model.graph.output.append(helper.make_tensor_value_info("p_neg", TensorProto.FLOAT, [4, 3]))
    onnx.checker.check_model(model, full_check=True)
    return model


def _commands(path: Path, tmp_path: Path) -> list:
    return [["optimize", path, "-o", tmp_path / "out.onnx", "--report", tmp_path / "r.json"], ["inspect", path],
            ["lower", path, "--soc", "Ascend910B2", "-o", tmp_path / "out.air"], ["check", path, path]]


def _assert_one_error(argv: list, path: Path, where: str, tmp_path: Path) -> None:
    code, err = _run(argv)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1, (argv, err)
    assert lines[0].startswith(f"error: {path}: {where} (b'\\xff\\xfe"), (argv, err)
    assert "is not valid UTF-8" in lines[0] and "rename it in the exporter or with onnx's Python API" in lines[0], (argv, err)
    assert not any((tmp_path / name).exists() for name in ("out.onnx", "r.json", "out.air", "out.init.air", "st.npz")), argv


@pytest.mark.parametrize("place", sorted(_NESTED))
def test_a_name_that_is_not_utf8_inside_a_subgraph_is_refused_by_every_command(place, tmp_path):
    path = _with_bytes(_nested_model(place), _NESTED[place][2], tmp_path / "nested.onnx")
    where = _NESTED[place][3]
    for argv in _commands(path, tmp_path):
        _assert_one_error(argv, path, where, tmp_path)
    model = onnx.load(path)
    for call in (sgdfuse.optimize, sgdfuse.inspect):
        from sgdfuse.errors import ModelNameError

        with pytest.raises(ModelNameError) as raised:
            call(model)
        assert raised.value.where == where and raised.value.name.startswith(b"\xff\xfe")


def test_a_name_that_is_not_utf8_in_a_model_function_body_is_refused_by_every_command(tmp_path):
    path = _with_bytes(_function_model(), b"NESTNODE", tmp_path / "function.onnx")
    where = "the name of node #0 (Neg) in the body of model function #0 (local::Negate)"
    for argv in _commands(path, tmp_path):
        _assert_one_error(argv, path, where, tmp_path)


def test_state_refuses_a_fused_model_with_a_name_that_is_not_utf8_in_a_subgraph(tmp_path):
    import numpy as np

    fused = sgdfuse.optimize(_nested_model("node name")).model
    path = _with_bytes(fused, b"NESTNODE", tmp_path / "fused.onnx")
    checkpoint = tmp_path / "ckpt.npz"
    np.savez(checkpoint, p=np.ones((4, 3), np.float32))
    # The If is now node #2 of the fused model (the update's four nodes are one SGD node).
    where = "the name of node #0 (Identity) in the then_branch of node #2 (If)"
    _assert_one_error(["state", checkpoint, "--model", path, "-o", tmp_path / "st.npz"], path, where, tmp_path)


def test_a_name_that_is_not_utf8_in_a_graphs_attribute_is_refused(tmp_path):
    # A GRAPHS attribute (a list of graphs, as a custom op may hold) is read like g: the rewrite keeps the node.
    from sgdfuse.errors import ModelNameError

    model = _update_model()
    bodies = [_branch([helper.make_node("Neg", ["p"], [f"out{j}"], name=f"NESTNOD{j}")], f"out{j}", f"g{j}") for j in range(2)]
    model.graph.node.append(helper.make_node("Custom", ["p"], ["p_c"], name="custom", domain="vendor", bodies=bodies))
    model.graph.output.append(helper.make_tensor_value_info("p_c", TensorProto.FLOAT, [4, 3]))
    model.opset_import.append(helper.make_opsetid("vendor", 1))
    path = _with_bytes(model, b"NESTNOD1", tmp_path / "graphs.onnx")
    for call in (sgdfuse.optimize, sgdfuse.inspect):
        with pytest.raises(ModelNameError) as raised:
            call(path)
        assert raised.value.where == "the name of node #0 (Neg) in the bodies of node #4 (Custom)", raised.value.where

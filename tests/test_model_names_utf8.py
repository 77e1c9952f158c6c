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

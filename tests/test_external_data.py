"""Models whose weights live in ONNX external data files: optimised without loading the weight bytes, written
with the data intact and referenced from the new location; a missing data file is a clear error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import sgdfuse
from sgdfuse.errors import ModelLoadError


def _model_with_external_weight(directory, weight_elements: int, *, write_data: bool = True, sparse: bool = False):
    """A forward MatMul on a large external weight ``w_frozen`` plus two momentum updates on graph inputs."""
    side = int(np.sqrt(weight_elements))
    nodes = [helper.make_node("MatMul", ["x", "w_frozen"], ["y"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, side])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, side])]
    initializers = [numpy_helper.from_array(np.array(0.9, np.float32), "m"), numpy_helper.from_array(np.array(-0.01, np.float32), "neg_lr")]
    for k in range(2):
        p, g, b = f"p{k}", f"g{k}", f"buf{k}"
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4, 3]) for n in (p, g, b)]
        nodes += [
            helper.make_node("Mul", [b, "m"], [f"bm{k}"]),
            helper.make_node("Add", [f"bm{k}", g], [f"{b}_out"]),
            helper.make_node("Mul", [f"{b}_out", "neg_lr"], [f"step{k}"]),
            helper.make_node("Add", [p, f"step{k}"], [f"{p}_out"]),
        ]
        outputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4, 3]) for n in (f"{p}_out", f"{b}_out")]
    weight = TensorProto()
    weight.name = "w_frozen"
    weight.data_type = TensorProto.FLOAT
    weight.dims.extend([side, side])
    weight.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "weights.bin"), ("offset", "0"), ("length", str(side * side * 4))):
        entry = weight.external_data.add()
        entry.key, entry.value = key, value
    initializers.append(weight)
    model = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, initializer=initializers), opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    path = directory / "model.onnx"
    onnx.save(model, path)
    if write_data:
        with open(directory / "weights.bin", "wb") as handle:
            if sparse:
                handle.truncate(side * side * 4)  # a sparse file: no disk blocks, reads as zeros
            else:
                handle.write(np.arange(side * side, dtype=np.float32).tobytes())
    return path


def test_external_weights_stay_on_disk_and_are_referenced_from_the_new_location(tmp_path):
    source = tmp_path / "in"
    source.mkdir()
    path = _model_with_external_weight(source, 64 * 64)
    before = (source / "weights.bin").read_bytes()

    result = sgdfuse.optimize(path)
    assert len(result.report.fused) == 2
    weight = next(t for t in result.model.graph.initializer if t.name == "w_frozen")
    assert weight.data_location == TensorProto.EXTERNAL and not weight.raw_data  # bytes never loaded

    out = tmp_path / "elsewhere" / "deeper"
    out.mkdir(parents=True)
    result.save(out / "fused.onnx")
    # ONNX resolves external data only inside the model's directory: the data file is copied there.
    assert (out / "weights.bin").read_bytes() == before
    reloaded = onnx.load(out / "fused.onnx")  # resolves the data from the new location
    np.testing.assert_array_equal(numpy_helper.to_array(next(t for t in reloaded.graph.initializer if t.name == "w_frozen")).reshape(-1), np.frombuffer(before, np.float32))
    assert (source / "weights.bin").read_bytes() == before
    onnx.checker.check_model(str(out / "fused.onnx"), full_check=True)


def test_saving_beside_the_input_keeps_the_location_unchanged(tmp_path):
    path = _model_with_external_weight(tmp_path, 16 * 16)
    result = sgdfuse.optimize(path)
    result.save(tmp_path / "fused.onnx")
    written = onnx.load(tmp_path / "fused.onnx", load_external_data=False)
    weight = next(t for t in written.graph.initializer if t.name == "w_frozen")
    assert [e.value for e in weight.external_data if e.key == "location"] == ["weights.bin"]


def test_missing_external_data_file_is_a_clear_error(tmp_path):
    path = _model_with_external_weight(tmp_path, 16 * 16, write_data=False)
    with pytest.raises(ModelLoadError, match=r"external data file 'weights.bin' of tensor 'w_frozen' is missing"):
        sgdfuse.optimize(path)
    result = subprocess.run([sys.executable, "-m", "sgdfuse.cli", "optimize", str(path)], capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr.strip().startswith("error:") and "weights.bin" in result.stderr
    assert not (tmp_path / "model.sgdfused.onnx").exists()


@pytest.mark.slow
def test_model_past_two_gigabytes_is_optimised_without_reading_its_weights(tmp_path):
    # 2.25 GB of external weights in a sparse file: optimising in a fresh process must neither fail at
    # protobuf's 2 GB limit nor read the bytes (peak RSS stays far below the data size).
    elements = 24_000 * 24_000  # 576e6 floats = 2.3 GB
    path = _model_with_external_weight(tmp_path, elements, sparse=True)
    assert os.path.getsize(tmp_path / "weights.bin") > 2 * 1024**3
    script = textwrap.dedent(
        f"""
        import json, resource, sgdfuse
        result = sgdfuse.optimize({str(path)!r})
        result.save({str(tmp_path / 'out' / 'fused.onnx')!r})
        print(json.dumps({{"fused": len(result.report.fused), "rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}}))
        """
    )
    (tmp_path / "out").mkdir()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["fused"] == 2
    assert figures["rss_kb"] < 1024 * 1024, figures  # < 1 GiB: the 2.3 GB of weights were never read
    assert os.path.getsize(tmp_path / "out" / "weights.bin") == os.path.getsize(tmp_path / "weights.bin")
    written = onnx.load(tmp_path / "out" / "fused.onnx", load_external_data=False)
    weight = next(t for t in written.graph.initializer if t.name == "w_frozen")
    assert [e.value for e in weight.external_data if e.key == "location"] == ["weights.bin"]

"""Model files are untrusted: the external-data locations a model names never make sgdfuse read or write
outside the model's directory and the output's directory (docs/untrusted-models.md).

Each refusal is checked the same way: exit 1 with one ``error:`` line naming the tensor and the location,
every file under the test's temporary directory exactly as before (nothing written, nothing replaced), and
the file the location aims at never opened (a Python audit hook records every ``open``)."""

from __future__ import annotations

import hashlib
import os
import stat
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import sgdfuse
from sgdfuse.cli import main
from sgdfuse.errors import ExternalDataError, ModelLoadError, OutputWriteError

SIDE = 8
WEIGHT = np.arange(SIDE * SIDE, dtype=np.float32).reshape(SIDE, SIDE)
SECOND = -np.arange(SIDE * SIDE, dtype=np.float32).reshape(SIDE, SIDE)

_OPENED: list[str] | None = None


def _audit(event: str, args: tuple) -> None:
    if _OPENED is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.path.realpath(os.fsdecode(args[0])))


sys.addaudithook(_audit)


def _run(*args, capsys) -> tuple[int, str, str, list[str]]:
    """``sgdfuse ARGS`` in this process: (exit code, stdout, stderr, every path opened meanwhile)."""
    global _OPENED
    _OPENED = []
    try:
        with pytest.raises(SystemExit) as exited:
            main([*map(str, args)])
    finally:
        opened, _OPENED = _OPENED, None
    captured = capsys.readouterr()
    return int(exited.value.code or 0), captured.out, captured.err, opened


def _external(name: str, location: str, *, offset: int | str | None = 0, length: int | str | None = SIDE * SIDE * 4) -> TensorProto:
    tensor = TensorProto()
    tensor.name = name
    tensor.data_type = TensorProto.FLOAT
    tensor.dims.extend([SIDE, SIDE])
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", offset), ("length", length)):
        if value is not None:
            entry = tensor.external_data.add()
            entry.key, entry.value = key, str(value)
    return tensor


def _write_model(path, weights: list[TensorProto]) -> str:
    """A forward MatMul chain over the external ``weights`` plus two momentum-SGD updates on graph inputs."""
    nodes, previous = [], "x"
    for k, weight in enumerate(weights):
        nodes.append(helper.make_node("MatMul", [previous, weight.name], [f"y{k}"]))
        previous = f"y{k}"
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, SIDE])]
    outputs = [helper.make_tensor_value_info(previous, TensorProto.FLOAT, [1, SIDE])]
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
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=initializers + list(weights))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.save(model, path)
    return str(path)


def _tree(root) -> dict[str, tuple]:
    """Every entry under ``root``: kind and contents (file bytes' digest, link target), for before/after."""
    entries = {}
    for directory, names, files in os.walk(root):
        for name in names + files:
            path = os.path.join(directory, name)
            info = os.lstat(path)
            if stat.S_ISLNK(info.st_mode):
                entries[path] = ("link", os.readlink(path))
            elif stat.S_ISREG(info.st_mode):
                with open(path, "rb") as handle:
                    entries[path] = ("file", hashlib.sha256(handle.read()).hexdigest(), info.st_mtime_ns)
            else:
                entries[path] = (stat.S_IFMT(info.st_mode),)
    return entries


@pytest.fixture
def layout(tmp_path):
    """``in/a/b/`` holds the model (and ``weights.bin``, a valid data file), ``in/a/secret.bin`` is the file
    an attacker aims at, ``out/`` is the (empty) output directory."""
    model_dir = tmp_path / "in" / "a" / "b"
    model_dir.mkdir(parents=True)
    (model_dir / "weights.bin").write_bytes(WEIGHT.tobytes())
    (tmp_path / "in" / "a" / "secret.bin").write_bytes(SECOND.tobytes())
    (tmp_path / "out").mkdir()
    return tmp_path


def _plant_dir(model_dir, location):
    os.mkdir(model_dir / "sub")
    return location


def _plant_fifo(model_dir, location):
    os.mkfifo(model_dir / "pipe")
    return location


def _plant_link_out(model_dir, location):
    os.symlink(model_dir.parent / "secret.bin", model_dir / "link.bin")
    return location


def _plant_linked_dir_out(model_dir, location):
    os.symlink(model_dir.parent, model_dir / "weights")
    return location


def _plant_link_to_device(model_dir, location):
    os.symlink("/dev/zero", model_dir / "zero")
    return location


def _plant_hard_link(model_dir, location):
    os.link(model_dir.parent / "secret.bin", model_dir / "alias.bin")
    return location


def _as_is(model_dir, location):
    return location


def _absolute_secret(model_dir, location):
    return str(model_dir.parent / "secret.bin")


# (id, how the location is made, location, offset, length, what the error says)
UNSAFE = [
    ("absolute path", _absolute_secret, None, 0, SIDE * SIDE * 4, "is an absolute path"),
    ("dev-zero", _as_is, "/dev/zero", 0, SIDE * SIDE * 4, "is an absolute path"),
    ("windows drive", _as_is, "C:\\secret.bin", 0, SIDE * SIDE * 4, "is an absolute path"),
    ("windows share", _as_is, "\\\\server\\share\\secret.bin", 0, SIDE * SIDE * 4, "is an absolute path"),
    ("dot-dot", _as_is, "../secret.bin", 0, SIDE * SIDE * 4, "points outside the model's directory"),
    ("dot-dot after normalisation", _as_is, "./weights/../../secret.bin", 0, SIDE * SIDE * 4, "points outside the model's directory"),
    ("dot-dot with backslashes", _as_is, "..\\secret.bin", 0, SIDE * SIDE * 4, "points outside the model's directory"),
    ("symlink out", _plant_link_out, "link.bin", 0, SIDE * SIDE * 4, "resolves through a symbolic link"),
    ("symlinked directory out", _plant_linked_dir_out, "weights/secret.bin", 0, SIDE * SIDE * 4, "resolves through a symbolic link"),
    ("symlink to a device", _plant_link_to_device, "zero", 0, SIDE * SIDE * 4, "resolves through a symbolic link"),
    ("directory", _plant_dir, "sub", 0, SIDE * SIDE * 4, "names a directory"),
    ("model directory itself", _as_is, "./weights/..", 0, SIDE * SIDE * 4, "names the model's directory itself"),
    ("fifo", _plant_fifo, "pipe", 0, SIDE * SIDE * 4, "names a FIFO"),
    ("hard link", _plant_hard_link, "alias.bin", 0, SIDE * SIDE * 4, "hard links"),
    ("offset past the end", _as_is, "weights.bin", SIDE * SIDE * 4 + 1, None, "past the end"),
    ("length past the end", _as_is, "weights.bin", 4, SIDE * SIDE * 4, "past the end"),
    ("negative offset", _as_is, "weights.bin", -4, SIDE * SIDE * 4, "not a non-negative integer"),
    ("non-integer length", _as_is, "weights.bin", 0, "256.0", "not a non-negative integer"),
    ("empty location", _as_is, "", 0, SIDE * SIDE * 4, "is empty"),
    ("NUL byte", _as_is, "weights.bin\0../../secret.bin", 0, SIDE * SIDE * 4, "holds a NUL byte"),
]


@pytest.mark.parametrize("plant, location, offset, length, says", [case[1:] for case in UNSAFE], ids=[case[0] for case in UNSAFE])
def test_optimize_refuses_an_unsafe_location_and_writes_nothing(layout, capsys, plant, location, offset, length, says):
    model_dir = layout / "in" / "a" / "b"
    location = plant(model_dir, location)
    model = _write_model(model_dir / "model.onnx", [_external("w_frozen", location, offset=offset, length=length)])
    before = _tree(layout)

    code, out, err, opened = _run("optimize", model, "-o", layout / "out" / "fused.onnx", "--report", layout / "out" / "r.json", capsys=capsys)

    assert code == 1
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "'w_frozen'" in err and f"location {location!r}" in err and says in err, err
    assert _tree(layout) == before  # nothing written or replaced anywhere under the temporary directory
    aimed_at = {str(layout / "in" / "a" / "secret.bin"), "/dev/zero", str(model_dir / "pipe")}
    assert not aimed_at & set(opened)


def test_a_repeated_location_key_is_refused(layout):
    # onnx keeps the last of repeated keys; a checker that read the first would check another file.
    model_dir = layout / "in" / "a" / "b"
    tensor = _external("w_frozen", "weights.bin")
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", "../secret.bin"
    model = _write_model(model_dir / "model.onnx", [tensor])
    with pytest.raises(ExternalDataError, match="has the key 'location' twice"):
        sgdfuse.load_model(model)


UNSAFE_FOR_EVERY_COMMAND = [case for case in UNSAFE if case[0] in ("dot-dot", "symlink out", "offset past the end")]


@pytest.mark.parametrize("command", ["inspect", "check", "lower", "lower-onnx-atc"])
@pytest.mark.parametrize("plant, location, offset, length, says", [c[1:] for c in UNSAFE_FOR_EVERY_COMMAND], ids=[c[0] for c in UNSAFE_FOR_EVERY_COMMAND])
def test_every_command_refuses_an_unsafe_location(layout, capsys, command, plant, location, offset, length, says):
    model_dir = layout / "in" / "a" / "b"
    location = plant(model_dir, location)
    model = _write_model(model_dir / "model.onnx", [_external("w_frozen", location, offset=offset, length=length)])
    safe = _write_model(layout / "in" / "safe.onnx", [onnx.numpy_helper.from_array(WEIGHT, "w_frozen")])
    before = _tree(layout)
    out = layout / "out"
    args = {
        "inspect": ["inspect", model, "--report", out / "r.json"],
        "check": ["check", safe, model],
        "lower": ["lower", model, "--soc", "Ascend910B2", "-o", out / "m.air", "--json", out / "m.json"],
        "lower-onnx-atc": ["lower", model, "--soc", "Ascend910B2", "--format", "onnx-atc", "-o", out / "m.atc.onnx"],
    }[command]

    code, _, err, opened = _run(*args, capsys=capsys)

    assert code == 1
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "'w_frozen'" in err and f"location {location!r}" in err and says in err, err
    assert _tree(layout) == before
    assert str(layout / "in" / "a" / "secret.bin") not in opened


def test_the_library_refuses_before_reading(layout):
    model_dir = layout / "in" / "a" / "b"
    model = _write_model(model_dir / "model.onnx", [_external("w_frozen", "../secret.bin")])
    for call in (sgdfuse.load_model, lambda p: sgdfuse.load_model(p, load_external_data=True), sgdfuse.optimize, sgdfuse.inspect):
        with pytest.raises(ExternalDataError) as refused:
            call(model)
        assert refused.value.tensor == "w_frozen" and refused.value.location == "../secret.bin"
        assert isinstance(refused.value, ModelLoadError)


def test_a_model_given_as_proto_is_not_saved_with_an_escaping_location(layout):
    # No file was read, but the written model must not point outside its directory either.
    model = onnx.load(_write_model(layout / "in" / "a" / "b" / "model.onnx", [_external("w_frozen", "../secret.bin")]), load_external_data=False)
    result = sgdfuse.optimize(model, verify=False)
    before = _tree(layout)
    with pytest.raises(ExternalDataError, match="points outside"):
        result.save(layout / "out" / "fused.onnx")
    assert _tree(layout) == before


def test_a_proto_with_external_data_not_loaded_is_never_read_from_the_current_directory(layout, monkeypatch):
    # onnx.numpy_helper.to_array would resolve the location against the current directory, unchecked.
    _write_model(layout / "in" / "a" / "b" / "model.onnx", [_external("w_frozen", "weights.bin")])
    monkeypatch.chdir(layout / "in" / "a" / "b")
    model = onnx.load("model.onnx", load_external_data=False)
    with pytest.raises(ModelLoadError, match="stored externally and was not loaded"):
        sgdfuse.lower(model, soc="Ascend910B2")


# Writes: data files land in the output's directory, under names that cannot escape it.


def _valid_model(layout, *, location="weights/w.bin", second="weights/w.bin") -> str:
    """Two external weights sharing one data file (at offsets 0 and 256) under a nested location."""
    model_dir = layout / "in" / "a" / "b"
    data = model_dir / location.replace("./", "")
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_bytes(WEIGHT.tobytes() + SECOND.tobytes())
    return _write_model(model_dir / "model.onnx", [_external("w_frozen", location), _external("w_second", second, offset=SIDE * SIDE * 4)])


def test_a_valid_external_data_model_round_trips_through_every_command(layout, capsys):
    model = _valid_model(layout, location="./weights/w.bin")
    out = layout / "out"
    code, _, err, _ = _run("optimize", model, "-o", out / "fused.onnx", capsys=capsys)
    assert code == 0, err

    # One copy of the shared file, inside the output directory, referenced by both tensors (normalised).
    assert sorted(str(p.relative_to(layout)) for p in layout.rglob("*") if p.is_file()) == [
        "in/a/b/model.onnx", "in/a/b/weights.bin", "in/a/b/weights/w.bin", "in/a/secret.bin", "out/fused.onnx", "out/weights/w.bin",
    ]
    written = onnx.load(out / "fused.onnx", load_external_data=False)
    locations = {t.name: {e.key: e.value for e in t.external_data} for t in written.graph.initializer if t.data_location == TensorProto.EXTERNAL}
    assert locations == {
        "w_frozen": {"location": "weights/w.bin", "offset": "0", "length": "256"},
        "w_second": {"location": "weights/w.bin", "offset": "256", "length": "256"},
    }
    onnx.checker.check_model(str(out / "fused.onnx"), full_check=True)  # onnx's own external-data checks pass
    loaded = {t.name: numpy_helper.to_array(t) for t in onnx.load(out / "fused.onnx").graph.initializer}
    np.testing.assert_array_equal(loaded["w_frozen"], WEIGHT)
    np.testing.assert_array_equal(loaded["w_second"], SECOND)

    code, _, err, _ = _run("check", model, out / "fused.onnx", capsys=capsys)
    assert code == 0, err
    code, _, err, _ = _run("inspect", out / "fused.onnx", capsys=capsys)
    assert code == 0, err
    code, _, err, _ = _run("lower", out / "fused.onnx", "--soc", "Ascend910B2", "-o", out / "m.air", capsys=capsys)
    assert code == 0, err
    air = (out / "m.air").read_bytes()
    assert WEIGHT.tobytes() in air and SECOND.tobytes() in air  # the GE graph's constants hold the checked bytes


def test_writing_beside_the_input_copies_nothing_and_keeps_the_location(layout):
    model = _valid_model(layout)
    sgdfuse.optimize(model).save(layout / "in" / "a" / "b" / "fused.onnx")
    written = onnx.load(layout / "in" / "a" / "b" / "fused.onnx")
    np.testing.assert_array_equal(numpy_helper.to_array(next(t for t in written.graph.initializer if t.name == "w_second")), SECOND)
    assert sorted(p.name for p in (layout / "in" / "a" / "b").rglob("*")) == ["fused.onnx", "model.onnx", "w.bin", "weights", "weights.bin"]


def test_a_symbolic_link_that_stays_inside_the_model_directory_is_followed(layout):
    model_dir = layout / "in" / "a" / "b"
    os.symlink("weights.bin", model_dir / "link.bin")
    model = _write_model(model_dir / "model.onnx", [_external("w_frozen", "link.bin")])
    sgdfuse.optimize(model).save(layout / "out" / "fused.onnx")
    copy = layout / "out" / "link.bin"
    assert not copy.is_symlink() and copy.read_bytes() == WEIGHT.tobytes()


@pytest.mark.parametrize(
    "occupy, says",
    [
        (lambda out, elsewhere: os.symlink(elsewhere / "target.bin", out / "weights"), "is not a directory (or is a symbolic link)"),
        (lambda out, elsewhere: os.symlink(elsewhere, out / "weights"), "is not a directory (or is a symbolic link)"),
        (lambda out, elsewhere: (out / "weights").mkdir() or os.symlink(elsewhere / "target.bin", out / "weights" / "w.bin"), "is a symbolic link"),
        (lambda out, elsewhere: (out / "weights").mkdir() or (out / "weights" / "w.bin").write_bytes(b"other"), "already exists with other contents"),
    ],
    ids=["file link on the way", "directory link on the way", "link at the name", "another file at the name"],
)
def test_a_data_file_is_never_written_through_a_link_or_over_another_file(layout, capsys, occupy, says):
    model = _valid_model(layout)
    elsewhere = layout / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "target.bin").write_bytes(b"keep me")
    occupy(layout / "out", elsewhere)
    before = _tree(layout)
    code, _, err, _ = _run("optimize", model, "-o", layout / "out" / "fused.onnx", capsys=capsys)
    assert code == 1 and err.startswith("error: ") and says in err, err
    assert _tree(layout) == before


def test_a_data_file_named_like_the_output_model_is_refused(layout):
    model_dir = layout / "in" / "a" / "b"
    (model_dir / "fused.onnx").write_bytes(WEIGHT.tobytes())
    model = _write_model(model_dir / "model.onnx", [_external("w_frozen", "fused.onnx")])
    result = sgdfuse.optimize(model)
    before = _tree(layout)
    with pytest.raises(OutputWriteError, match="named twice"):
        result.save(layout / "out" / "fused.onnx")
    with pytest.raises(OutputWriteError, match="is the external data file 'fused.onnx'"):
        result.save(model_dir / "fused.onnx")
    assert _tree(layout) == before


def test_data_files_and_directories_go_when_another_output_fails(layout):
    from sgdfuse.output import OutputBatch

    result = sgdfuse.optimize(_valid_model(layout))
    blocked = layout / "out" / "not-a-directory"
    blocked.write_text("x")
    before = _tree(layout)
    with pytest.raises(OutputWriteError):
        with OutputBatch() as batch:
            result.save(layout / "out" / "fused.onnx", batch=batch)  # stages out/weights/w.bin, makes out/weights
            batch.stage(blocked / "r.json", b"{}")
            batch.commit()
    assert _tree(layout) == before


# MindIR: a large model's parameters live in data files the model names (``<name>_variables/data_N``).

MINDIR = os.path.join(os.path.dirname(__file__), os.pardir, "testdata", "mindspore", "train_step_sgd.mindir")


def _split_mindir(path, location: str) -> None:
    """``train_step_sgd.mindir`` with its parameters moved to the data file ``location``, laid out as
    MindSpore's own split export writes it (a 64-byte header whose first byte marks little-endian data, each
    parameter at a 64-byte boundary)."""
    from mindspore.train import mind_ir_pb2

    model = mind_ir_pb2.ModelProto()
    with open(MINDIR, "rb") as handle:
        model.ParseFromString(handle.read())
    blob = bytearray(b"\x01" + bytes(63))
    for parameter in model.graph.parameter:
        if parameter.raw_data:
            parameter.external_data.location = location
            parameter.external_data.offset = len(blob)
            parameter.external_data.length = len(parameter.raw_data)
            blob += parameter.raw_data + bytes(-len(parameter.raw_data) % 64)
            parameter.ClearField("raw_data")
    data = os.path.join(os.path.dirname(path), location)
    if not os.path.lexists(data) and ".." not in location:  # an attacker's location: its target is left as it is
        os.makedirs(os.path.dirname(data), exist_ok=True)
        with open(data, "wb") as handle:
            handle.write(bytes(blob))
    with open(path, "wb") as handle:
        handle.write(model.SerializeToString())


def test_a_split_mindir_is_fused_checked_and_written_with_its_data_file_inside_the_output(layout, capsys):
    pytest.importorskip("mindspore", reason="MindSpore is not installed here (CI installs .[test,mindspore])")
    from sgdfuse.mindspore import check_mindir

    model = layout / "in" / "a" / "b" / "step.mindir"
    _split_mindir(model, "step_variables/data_0")
    out = layout / "out" / "fused.mindir"
    code, stdout, err, _ = _run("optimize", model, "-o", out, capsys=capsys)
    assert code == 0, err
    assert "agree within the derived bound" in stdout and "failed" not in stdout  # checked on the real bytes
    copy = layout / "out" / "step_variables" / "data_0"
    assert copy.read_bytes() == (model.parent / "step_variables" / "data_0").read_bytes()
    assert check_mindir(str(model), str(out), steps=2).passed  # MindSpore loads the written file and its data


@pytest.mark.parametrize("plant, location", [(_as_is, "../secret.bin"), (_plant_link_out, "link.bin")], ids=["dot-dot", "symlink out"])
def test_a_mindir_naming_a_data_file_outside_its_directory_is_refused(layout, capsys, plant, location):
    pytest.importorskip("mindspore", reason="MindSpore is not installed here (CI installs .[test,mindspore])")
    model_dir = layout / "in" / "a" / "b"
    location = plant(model_dir, location)
    model = model_dir / "step.mindir"
    _split_mindir(model, location)
    before = _tree(layout)
    code, _, err, opened = _run("optimize", model, "-o", layout / "out" / "fused.mindir", capsys=capsys)
    assert code == 1 and err.startswith("error: ") and err.count("\n") == 1, err
    assert f"location {location!r}" in err and "opt.l1.weight" in err
    assert _tree(layout) == before
    assert str(layout / "in" / "a" / "secret.bin") not in opened

    from sgdfuse.mindspore import check_mindir

    for pair in ((model, MINDIR), (MINDIR, model)):  # sgdfuse's MindSpore check refuses it on either side
        with pytest.raises(ExternalDataError, match="opt.l1.weight"):
            check_mindir(str(pair[0]), str(pair[1]), steps=1)


def test_two_outputs_naming_one_file_are_refused(layout, capsys):
    model = _valid_model(layout)
    same = layout / "out" / "fused.onnx"
    code, _, err, _ = _run("optimize", model, "-o", same, "--report", same, capsys=capsys)
    assert code == 1 and "named twice" in err, err
    assert list((layout / "out").iterdir()) == []


@pytest.mark.parametrize(
    "command",
    [
        ["optimize", "{model}", "-o", "{out}/fused.onnx", "--report", "{data}"],
        ["inspect", "{model}", "--report", "{data}"],
        ["lower", "{model}", "--soc", "Ascend910B2", "-o", "{out}/l.air", "--json", "{data}"],
        ["optimize", "{model}", "-o", "{out}/fused.onnx", "--report", "{dir}/missing/../weights.bin"],
    ],
    ids=["optimize-report", "inspect-report", "lower-json", "optimize-report-dotdot"],
)
def test_no_output_is_written_over_a_data_file_of_the_input(layout, capsys, command):
    # A report or JSON dump named like the input's external data file replaced the weights with JSON and
    # exited 0 (a fresh trial's finding); the data files an input names are input as much as the model is.
    model_dir = layout / "in" / "a" / "b"
    model = _write_model(model_dir / "model.onnx", [_external("w_frozen", "weights.bin")])
    data = model_dir / "weights.bin"
    before = _tree(layout)
    argv = [part.format(model=model, out=layout / "out", data=data, dir=model_dir) for part in command]
    code, _, err, _ = _run(*argv, capsys=capsys)
    assert code == 1
    assert "is the external data file 'weights.bin' of tensor 'w_frozen' of the input" in err, err
    assert _tree(layout) == before

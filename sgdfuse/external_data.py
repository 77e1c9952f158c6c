"""Tensor data stored outside a model file: the one place where sgdfuse checks, reads and copies it.

A model file from an untrusted source names its data files itself (ONNX ``TensorProto.external_data``
``location``/``offset``/``length``; MindIR ``TensorProto.external_data``). Every such name is untrusted: it is
checked here before any file is opened, and every reader in sgdfuse (loading, ``check``, lowering, the GE
writer, the MindIR path) and every writer of data files beside an output goes through this module.

The rules are onnx's (``onnx.external_data_helper`` and the C++ opener behind it, which onnx added for its
path-traversal and hard-link advisories); sgdfuse applies them itself because it reads data files without
``onnx.load`` (the pass never loads weight bytes) and copies them when a model is written elsewhere. A
location is refused when it

* is empty, holds a NUL byte, or is absolute (``/x``, ``C:\\x``, ``C:x``, ``\\\\server\\share``);
* still has a ``..`` part after normalisation (``\\`` counts as a separator, as in onnx's check);
* resolves, through symbolic links, to a place outside the model's directory;
* is not a regular file (a directory, a device, a FIFO, a socket) or does not exist;
* is a file with several hard links (onnx's hard-link-attack rule: such a file can be any file on the disk);

and an ``offset`` or ``length`` that is not a non-negative decimal integer, or that reaches past the end of
the file, is refused. Where sgdfuse differs from onnx: a symbolic link whose target stays inside the model's
directory is accepted (onnx refuses every link); keys repeated in one tensor are refused (onnx keeps the
last). Files are opened with ``O_NOFOLLOW | O_NONBLOCK`` and checked again on the open descriptor, so a file
swapped after the check is refused too, and opening a FIFO never blocks.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import posixpath
import re
import stat
from collections.abc import Iterator

import numpy as np
import onnx
from onnx import numpy_helper

from sgdfuse.errors import ExternalDataError, ModelLoadError, OutputWriteError

__all__ = [
    "ExternalData",
    "external_tensors",
    "may_hold_external_data",
    "normalise_location",
    "check_location",
    "check_tensor",
    "check_model",
    "open_checked",
    "read_bytes",
    "load_external_data",
    "tensor_to_array",
    "copy_data_files",
    "stage_data_files",
    "normalised_locations",
]

logger = logging.getLogger(__name__)

_KEYS = {"location", "offset", "length", "checksum", "basepath"}
_DECIMAL = re.compile(r"[0-9]+\Z")
_DRIVE = re.compile(r"[A-Za-z]:")


@dataclasses.dataclass(frozen=True)
class ExternalData:
    """One tensor's external data, checked.

    Attributes:
        tensor: the tensor's name.
        location: the location as the model gives it.
        normalised: the same location, ``/``-separated, without ``.`` parts (what sgdfuse writes back).
        path: the data file's real path (inside the model's directory).
        offset: first byte of the tensor's data in the file.
        length: bytes of data (the rest of the file when the model gives no length).
        device, inode: the checked file's identity, compared again on the open descriptor.
    """

    tensor: str
    location: str
    normalised: str
    path: str
    offset: int
    length: int
    device: int
    inode: int


def _markers() -> tuple[bytes, ...]:
    """Byte strings one of which the file of a model with an external tensor holds (see
    :func:`may_hold_external_data`)."""
    field = onnx.TensorProto.DESCRIPTOR.fields_by_name["data_location"]
    # Protobuf wire format: the key of a varint field is (number << 3 | 0); EXTERNAL = 1 is the one byte 0x01.
    tag = bytes([field.number << 3]) if field.number < 16 else None
    external = tag + bytes([onnx.TensorProto.EXTERNAL]) if tag is not None else None
    # "location" is the key every external data entry must have (a file is named nowhere else).
    return tuple(m for m in (b"location", external) if m is not None)


_MARKERS = _markers()


def may_hold_external_data(data: bytes) -> bool:
    """False only when the serialised model ``data`` holds no tensor whose data is external, proved from its
    bytes without parsing. ``data`` must be protobuf's binary format, where strings are written as they are:
    every data file is named by an ``external_data`` entry keyed ``location``, whose bytes then appear in
    ``data``, and a tensor marked ``data_location = EXTERNAL`` is written as the field key of
    ``TensorProto.data_location`` (14) followed by the byte 1. Bytes without either name no data file, so the
    walk over every node attribute (:func:`external_tensors`, a large share of a load's cost for a graph of
    many small nodes) can be skipped. Text formats (JSON with escaped characters and enum numbers, say) are not
    covered: a model read from one is always walked.

    Source: protobuf's wire format (encoding of varint fields, and embedded messages, which nest their bytes
    unchanged); ``onnx.proto`` ``TensorProto`` fields 13 (``external_data``) and 14 (``data_location``). A
    crafted file could spell the ``data_location`` marker as an over-long varint: such a tensor names no file
    (no ``location``), and reading its data is refused (:func:`tensor_to_array`).
    """
    return any(data.find(marker) >= 0 for marker in _MARKERS)


def external_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every ``TensorProto`` of ``model`` whose data is external: initializers, sparse initializers,
    ``Constant``-style attribute tensors, in the main graph, every subgraph and every model-local function."""
    graphs = [model.graph]
    attributes: list[onnx.AttributeProto] = [a for f in model.functions for n in f.node for a in n.attribute]
    while graphs or attributes:
        if graphs:
            graph = graphs.pop()
            yield from _if_external([*graph.initializer, *_sparse_parts(graph.sparse_initializer)])
            attributes.extend(a for n in graph.node for a in n.attribute)
            continue
        attribute = attributes.pop()
        yield from _if_external([*([attribute.t] if attribute.HasField("t") else []), *attribute.tensors])
        sparse = [attribute.sparse_tensor] if attribute.HasField("sparse_tensor") else []
        yield from _if_external(_sparse_parts([*sparse, *attribute.sparse_tensors]))
        graphs.extend([attribute.g] if attribute.HasField("g") else [])
        graphs.extend(attribute.graphs)


def _sparse_parts(sparse) -> list[onnx.TensorProto]:
    return [part for s in sparse for part in (s.values, s.indices)]


def _if_external(tensors) -> Iterator[onnx.TensorProto]:
    for tensor in tensors:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            yield tensor


def normalise_location(location: str) -> str | None:
    """``location`` as a safe relative path (``/``-separated, no ``.`` parts), or None when it is empty,
    holds a NUL byte, is absolute (POSIX or Windows style) or climbs out with ``..`` after normalisation.

    Example: ``"./weights\\\\w.bin"`` → ``"weights/w.bin"``; ``"a/../../x"`` → None.
    """
    if not location or "\0" in location:
        return None
    unified = location.replace("\\", "/")
    if unified.startswith("/") or _DRIVE.match(unified):
        return None
    normalised = posixpath.normpath(unified)
    if normalised in (".", "..") or normalised.startswith("../"):
        return None
    return normalised


def check_location(location: str, *, tensor: str, source: str) -> str:
    """``location`` normalised (:func:`normalise_location`), checked by itself, without the file system.

    Raises:
        ExternalDataError: it is empty, holds a NUL byte, is absolute, names the directory itself or climbs
            out with ``..``.
    """
    normalised = normalise_location(location)
    if normalised is None:
        raise ExternalDataError(source, tensor, location, _refusal_of_location(location))
    return normalised


def _refusal_of_location(location: str) -> str:
    if not location:
        return "is empty"
    if "\0" in location:
        return "holds a NUL byte"
    unified = location.replace("\\", "/")
    if unified.startswith("/") or _DRIVE.match(unified):
        return "is an absolute path"
    if posixpath.normpath(unified) == ".":
        return "names the model's directory itself, not a data file"
    return "points outside the model's directory (a '..' part)"


def _fields(tensor, source: str) -> tuple[str, str | None, str | None]:
    """(location, offset, length) of an ONNX tensor's external_data entries, each key at most once."""
    seen: dict[str, str] = {}
    for entry in tensor.external_data:
        if entry.key in seen:
            raise ExternalDataError(source, tensor.name, seen.get("location", ""), f"has the key {entry.key!r} twice")
        seen[entry.key] = entry.value
    unknown = sorted(set(seen) - _KEYS)
    if unknown:  # onnx ignores unknown keys with a warning; nothing reads them here either
        logger.warning("tensor %r: ignoring unknown external data key(s) %s", tensor.name, unknown)
    return seen.get("location", ""), seen.get("offset"), seen.get("length")


def check_tensor(tensor, base_dir: str, *, source: str, files: dict | None = None) -> ExternalData:
    """Check one tensor's external data against the rules in this module's docstring.

    Args:
        tensor: an ONNX ``TensorProto`` with ``data_location == EXTERNAL``, or a MindIR ``TensorProto`` with
            an ``external_data`` message (``location``, ``offset``, ``length`` as int64).
        base_dir: the model's directory.
        source: the model file, for messages.
        files: a cache (normalised location → resolved path and ``stat``) shared by the tensors of one model,
            so that a file many tensors share is resolved once.

    Raises:
        ExternalDataError: the location, file, offset or length breaks a rule.
        ModelLoadError: the data file is missing.
    """
    if isinstance(tensor, onnx.TensorProto):
        location, offset_text, length_text = _fields(tensor, source)
    else:  # MindIR: one ExternalDataProto with integer fields
        data = tensor.external_data
        location, offset_text, length_text = data.location, str(data.offset), str(data.length) if data.length else None
    name = tensor.name

    def refuse(reason: str) -> ExternalDataError:
        return ExternalDataError(source, name, location, reason)

    normalised = check_location(location, tensor=name, source=source)
    offset, length = 0, None
    for key, text in (("offset", offset_text), ("length", length_text)):
        if text is not None and not _DECIMAL.match(text):
            raise refuse(f"has {key} {text!r}, not a non-negative integer")
    if offset_text is not None:
        offset = int(offset_text)
    if length_text is not None:
        length = int(length_text)

    files = {} if files is None else files
    if normalised not in files:
        files[normalised] = _resolve(base_dir, normalised)
    base, path, info, inside = files[normalised]
    if not inside:
        raise refuse(f"resolves through a symbolic link to {path}, outside the model's directory {base}")
    if isinstance(info, FileNotFoundError):
        raise ModelLoadError(
            source,
            f"external data file {location!r} of tensor {name!r} is missing (looked in {base}); keep the data files beside the model",
        ) from info
    if isinstance(info, OSError):
        raise refuse(f"cannot be read ({info.strerror or info})") from info
    _check_file(info, refuse)
    if offset > info.st_size:
        raise refuse(f"has offset {offset}, past the end of the {info.st_size}-byte file")
    if length is None:
        length = info.st_size - offset
    elif offset + length > info.st_size:
        raise refuse(f"has offset {offset} and length {length}, past the end of the {info.st_size}-byte file")
    return ExternalData(name, location, normalised, path, offset, length, info.st_dev, info.st_ino)


def _resolve(base_dir: str, normalised: str) -> tuple[str, str, os.stat_result | OSError, bool]:
    """(real base directory, real path of the location, its ``stat`` or the error stat raised, whether the
    real path lies inside the real base directory)."""
    base = os.path.realpath(base_dir)
    path = os.path.realpath(os.path.join(base, normalised))
    inside = os.path.commonpath([base, path]) == base
    try:
        return base, path, os.stat(path), inside
    except OSError as error:
        return base, path, error, inside


def _check_file(info: os.stat_result, refuse) -> None:
    if stat.S_ISDIR(info.st_mode):
        raise refuse("names a directory, not a data file")
    if not stat.S_ISREG(info.st_mode):
        kind = "a FIFO" if stat.S_ISFIFO(info.st_mode) else "a socket" if stat.S_ISSOCK(info.st_mode) else "a device"
        raise refuse(f"names {kind}, not a regular data file")
    if info.st_nlink > 1:
        raise refuse(f"is a file with {info.st_nlink} hard links, so it could be any file on the disk (copy it to a file of its own)")


def check_model(model: onnx.ModelProto, path: str | os.PathLike, *, base_dir: str | None = None) -> list[ExternalData]:
    """Check every external tensor of ``model``, read from the file ``path`` (locations are relative to its
    directory, or to ``base_dir`` when given); returns one :class:`ExternalData` per tensor, in
    :func:`external_tensors` order.

    Raises:
        ExternalDataError: the first tensor that breaks a rule.
        ModelLoadError: a data file is missing.
    """
    source = os.fspath(path)
    base = base_dir if base_dir is not None else os.path.dirname(os.path.abspath(source))
    files: dict = {}
    return [check_tensor(tensor, base, source=source, files=files) for tensor in external_tensors(model)]


def data_files(path: str | os.PathLike) -> dict[str, ExternalData]:
    """The external data files the ONNX model file ``path`` names, by real path (one tensor each): files a
    command reading that model must never write, as it never writes the model itself.

    The file's bytes are searched for the external-data markers first (:func:`may_hold_external_data`; protobuf's
    binary format), so a model without external data is not parsed. A file that is missing or does not parse as
    an ONNX model names no data file here (the command's own load then says what is wrong with it).

    Raises:
        ExternalDataError: a location breaks a rule (as :func:`check_model`).
        ModelLoadError: a named data file is missing.
    """
    source = os.fspath(path)
    try:
        with open(source, "rb") as handle:
            content = handle.read()
    except OSError:
        return {}
    serialization_format = onnx.serialization.registry.get_format_from_file_extension(os.path.splitext(source)[1]) or "protobuf"
    if serialization_format == "protobuf" and not may_hold_external_data(content):
        return {}
    try:
        model = onnx.load_model_from_string(content, format=serialization_format)
    except Exception:  # not an ONNX model (a MindIR file, a truncated one): nothing to protect here
        return {}
    return {data.path: data for data in check_model(model, source)}


def open_checked(data: ExternalData, *, source: str, whole: bool = False) -> int:
    """A read-only descriptor on a checked data file (the caller closes it), refused if what is there now is
    not the file that was checked. ``whole``: only the file's identity is compared, not ``data``'s range
    (the caller reads several ranges, each checked by :func:`check_tensor`, or copies the whole file).

    Raises:
        ExternalDataError: the file cannot be opened, or changed (another file, no longer regular, a second
            hard link, shorter than the checked range) since it was checked.
    """
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        descriptor = os.open(data.path, flags)
    except OSError as error:
        raise ExternalDataError(source, data.tensor, data.location, f"cannot be opened ({error.strerror or error})") from error
    info = os.fstat(descriptor)
    if (info.st_dev, info.st_ino) != (data.device, data.inode) or not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
        os.close(descriptor)
        raise ExternalDataError(source, data.tensor, data.location, "changed between its check and its reading")
    if not whole and info.st_size < data.offset + data.length:
        os.close(descriptor)
        raise ExternalDataError(source, data.tensor, data.location, "shrank between its check and its reading")
    return descriptor


def read_bytes(data: ExternalData, *, source: str, descriptor: int | None = None) -> bytes:
    """The ``data.length`` bytes at ``data.offset`` of a checked data file (read through ``descriptor``
    when the caller opened the file already, with :func:`open_checked`).

    Raises:
        ExternalDataError: the file changed since it was checked, or cannot be read.
    """
    own = descriptor is None
    if own:
        descriptor = open_checked(data, source=source)
    try:
        chunks, position, remaining = [], data.offset, data.length
        while remaining:
            chunk = os.pread(descriptor, min(remaining, 1 << 30), position)
            if not chunk:
                raise ExternalDataError(source, data.tensor, data.location, "ended early while being read")
            chunks.append(chunk)
            position += len(chunk)
            remaining -= len(chunk)
        return b"".join(chunks)
    finally:
        if own:
            os.close(descriptor)


def load_external_data(model: onnx.ModelProto, path: str | os.PathLike, *, checked: list[ExternalData] | None = None) -> None:
    """Read every external tensor of ``model`` (loaded from ``path``) into ``raw_data``, in place, after
    checking them all; the tensors then describe their data inline, as after ``onnx.load``. ``checked``:
    :func:`check_model`'s result for this model, when the caller has it already.

    Raises:
        ExternalDataError: a tensor breaks a rule (nothing is read then) or its file changed meanwhile.
    """
    source = os.fspath(path)
    tensors = list(external_tensors(model))
    if checked is None:
        checked = check_model(model, source)
    descriptors: dict[str, int] = {}  # one open descriptor per data file
    try:
        for tensor, data in zip(tensors, checked):
            if data.path not in descriptors:
                descriptors[data.path] = open_checked(data, source=source, whole=True)
            tensor.raw_data = read_bytes(data, source=source, descriptor=descriptors[data.path])
            tensor.data_location = onnx.TensorProto.DEFAULT
            del tensor.external_data[:]
    finally:
        for descriptor in descriptors.values():
            os.close(descriptor)


def tensor_to_array(tensor: onnx.TensorProto) -> np.ndarray:
    """``numpy_helper.to_array`` for a tensor whose data is in the model, never read from a file.

    ``onnx.numpy_helper.to_array`` would resolve an external location against the current directory; here
    an external tensor is an error instead: load the model with
    ``sgdfuse.load_model(path, load_external_data=True)`` first.

    Raises:
        ModelLoadError: the tensor's data is external (not loaded).
    """
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        raise ModelLoadError(
            f"tensor {tensor.name!r}",
            "its data is stored externally and was not loaded; load the model with "
            "sgdfuse.load_model(path, load_external_data=True)",
        )
    return numpy_helper.to_array(tensor)


def copy_data_files(model: onnx.ModelProto, source_dir: str, target: str, batch, *, source: str = "<model>") -> onnx.ModelProto:
    """Stage in ``batch`` a copy of every data file ``model`` (read from ``source_dir``) refers to, inside the
    directory of ``target`` (the output model's real path), and return the model with normalised locations.

    Each distinct data file is copied once, whole, so tensors that share a file (at different offsets) still
    share it. The destination is the output directory joined with the normalised location, which cannot
    climb out of it; a symbolic link on the way is refused by the batch, and so is a destination that
    already holds other bytes (it is left alone). Nothing is copied when the output directory is the source
    directory.

    Args:
        model: the model to write (never mutated; a copy is returned when a location changes).
        source_dir: the directory the model was read from; its locations are checked again.
        target: the output model's resolved path (:func:`sgdfuse.output.resolve_destination`).
        batch: the :class:`sgdfuse.output.OutputBatch` the model itself is staged in.
        source: the model file, for messages.

    Raises:
        ExternalDataError: a location breaks a rule.
        OutputWriteError: a destination is taken by another file, or a copy failed.
    """
    tensors = list(external_tensors(model))  # one walk of the model serves the checks and the locations
    files: dict = {}
    checked = [check_tensor(tensor, source_dir, source=source, files=files) for tensor in tensors]
    stage_data_files(checked, source_dir, target, batch, source=source)
    return _normalised(model, tensors, target)


def stage_data_files(checked: list[ExternalData], source_dir: str, target: str, batch, *, source: str = "<model>") -> None:
    """Stage in ``batch`` one copy of each data file in ``checked`` (from :func:`check_tensor`), at its
    normalised location inside the directory of ``target``; nothing when that is ``source_dir`` itself.
    The model-format-neutral half of :func:`copy_data_files` (the MindIR writer uses it too).

    Raises:
        OutputWriteError: ``target`` is one of the data files, a destination is taken by another file or
            passes a symbolic link, or a copy failed.
        ExternalDataError: a data file changed since it was checked.
    """
    directory = os.path.dirname(target)
    for data in checked:
        if data.path == target:
            raise OutputWriteError(target, f"is the external data file {data.location!r} of tensor {data.tensor!r}; write the model elsewhere")
    if os.path.realpath(source_dir) == os.path.realpath(directory):
        return  # the data files are already there
    files: dict[str, ExternalData] = {}
    for data in checked:
        files.setdefault(data.normalised, data)
    for normalised, data in sorted(files.items()):
        descriptor = open_checked(data, source=source, whole=True)
        try:
            batch.stage_copy(os.path.join(directory, *normalised.split("/")), descriptor, within=directory)
        finally:
            os.close(descriptor)


def normalised_locations(model: onnx.ModelProto, path: str | os.PathLike = "<model>") -> onnx.ModelProto:
    """``model`` with every external location in normalised form (a copy when one changes; else ``model``);
    ``path`` is the file it is about to be written to, for messages.

    Raises:
        ExternalDataError: a location is empty, absolute or climbs out with ``..`` (see
            :func:`normalise_location`); the model is not written then.
    """
    return _normalised(model, list(external_tensors(model)), path)


def _normalised(model: onnx.ModelProto, tensors: list[onnx.TensorProto], path: str | os.PathLike) -> onnx.ModelProto:
    """:func:`normalised_locations` with ``tensors`` the model's :func:`external_tensors`."""
    changes = []
    for tensor in tensors:
        location, _, _ = _fields(tensor, os.fspath(path))
        if check_location(location, tensor=tensor.name, source=os.fspath(path)) != location:
            changes.append(tensor.name)
    if not changes:
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for tensor in external_tensors(copy):
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = normalise_location(entry.value)
    return copy

"""The GE IR message classes, built at import time from ``ge_ir.proto`` (no protoc, no generated code).

Why not a generated ``ge_ir_pb2.py``: generated modules check the protobuf runtime against the generator's
version, which ties the committed file to one protoc release and to a lower bound on the runtime. Building
the classes here from a ``FileDescriptorProto`` works on every protobuf runtime the package accepts
(``protobuf>=4.25``), needs no build step, and keeps ``ge_ir.proto`` the one source of truth: this module
parses it. The parser understands the subset of proto3 that file uses (packages, nested messages and enums,
scalar/message/enum fields, ``repeated``, ``map<,>``, ``oneof``, comments) and raises on anything else.

The classes live in a private ``DescriptorPool``, so they never clash with another copy of the GE schema
(torchair's ``ge_ir_pb2``, package ``ge.proto`` too) loaded in the same process.

Also here: the two data-type numberings GE uses, and the maps from ONNX element types to them.

- ``TensorDescriptor.dtype`` uses the proto enum ``DataType`` (DT_FLOAT = 1, DT_FLOAT16 = 2, DT_BF16 = 27...).
- Attribute values of kind "data type" and the ``Cast`` op's ``dst_type``/``Shape``'s ``dtype`` attributes
  carry the C++ ``ge::DataType`` numbering (FLOAT = 0, FLOAT16 = 1, INT32 = 3, INT64 = 9, BF16 = 27...).
  See docs/lowering.md ("Two dtype numberings").
"""

from __future__ import annotations

import re
from importlib import resources

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from onnx import TensorProto

__all__ = [
    "PROTO_SOURCE",
    "FILE_DESCRIPTOR",
    "ModelDef",
    "GraphDef",
    "OpDef",
    "AttrDef",
    "NamedAttrs",
    "ShapeDef",
    "TensorDescriptor",
    "TensorDef",
    "DataType",
    "ONNX_TO_GE_DTYPE",
    "ONNX_TO_GE_CPP_DTYPE",
    "GE_DTYPE_NAMES",
    "ge_dtype",
    "ge_cpp_dtype",
    "parse_proto",
    "ProtoSyntaxError",
]


class ProtoSyntaxError(ValueError):
    """``ge_ir.proto`` uses something the small parser does not understand (a bug in the schema file)."""


_SCALARS = {
    "double": descriptor_pb2.FieldDescriptorProto.TYPE_DOUBLE,
    "float": descriptor_pb2.FieldDescriptorProto.TYPE_FLOAT,
    "int64": descriptor_pb2.FieldDescriptorProto.TYPE_INT64,
    "uint64": descriptor_pb2.FieldDescriptorProto.TYPE_UINT64,
    "int32": descriptor_pb2.FieldDescriptorProto.TYPE_INT32,
    "uint32": descriptor_pb2.FieldDescriptorProto.TYPE_UINT32,
    "bool": descriptor_pb2.FieldDescriptorProto.TYPE_BOOL,
    "string": descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
    "bytes": descriptor_pb2.FieldDescriptorProto.TYPE_BYTES,
}
_TOKEN = re.compile(r'\s*(?:(//[^\n]*)|(/\*.*?\*/)|([A-Za-z_][A-Za-z0-9_.]*)|(-?\d+)|("[^"]*")|([{}=;<>,]))', re.S)
_LABEL_OPTIONAL = descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL
_LABEL_REPEATED = descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED
_TYPE_MESSAGE = descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE
_TYPE_ENUM = descriptor_pb2.FieldDescriptorProto.TYPE_ENUM


def _tokens(text: str) -> list[str]:
    tokens: list[str] = []
    position = 0
    while position < len(text):
        match = _TOKEN.match(text, position)
        if not match or match.end() == position:
            if text[position:].strip() == "":
                break
            raise ProtoSyntaxError(f"unexpected text at offset {position}: {text[position:position + 30]!r}")
        position = match.end()
        if match.group(1) or match.group(2):
            continue
        tokens.append(next(g for g in match.groups()[2:] if g is not None))
    return tokens


class _Parser:
    """Recursive-descent parser from proto3 text to a ``FileDescriptorProto`` (two passes: declare, then
    resolve type names with protobuf's scoping rule, innermost scope first)."""

    def __init__(self, text: str, filename: str) -> None:
        self.tokens = _tokens(text)
        self.position = 0
        self.file = descriptor_pb2.FileDescriptorProto(name=filename)
        self.pending: list[tuple[descriptor_pb2.FieldDescriptorProto, str, str]] = []  # field, type, scope
        self.kinds: dict[str, int] = {}  # full name (".pkg.Msg") -> TYPE_MESSAGE / TYPE_ENUM

    def peek(self) -> str | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        token = self.peek()
        if token is None or (expected is not None and token != expected):
            raise ProtoSyntaxError(f"expected {expected or 'a token'}, found {token!r} (token {self.position})")
        self.position += 1
        return token

    def parse(self) -> descriptor_pb2.FileDescriptorProto:
        while self.peek() is not None:
            keyword = self.take()
            if keyword == "syntax":
                self.take("=")
                self.file.syntax = self.take().strip('"')
                self.take(";")
            elif keyword == "package":
                self.file.package = self.take()
                self.take(";")
            elif keyword == "message":
                self.message(self.file.message_type.add(), "." + self.file.package)
            elif keyword == "enum":
                self.enum(self.file.enum_type.add(), "." + self.file.package)
            else:
                raise ProtoSyntaxError(f"unsupported top-level statement {keyword!r}")
        if self.file.syntax != "proto3":
            raise ProtoSyntaxError("only proto3 is supported")
        for field, type_name, scope in self.pending:
            full = self.resolve(type_name, scope)
            field.type = self.kinds[full]
            field.type_name = full
        return self.file

    def resolve(self, name: str, scope: str) -> str:
        while True:
            candidate = f"{scope}.{name}"
            if candidate in self.kinds:
                return candidate
            if not scope:
                raise ProtoSyntaxError(f"unknown type {name!r}")
            scope = scope.rsplit(".", 1)[0]

    def enum(self, enum: descriptor_pb2.EnumDescriptorProto, scope: str) -> None:
        enum.name = self.take()
        self.kinds[f"{scope}.{enum.name}"] = _TYPE_ENUM
        self.take("{")
        while self.peek() != "}":
            value = enum.value.add(name=self.take())
            self.take("=")
            value.number = int(self.take())
            self.take(";")
        self.take("}")

    def message(self, message: descriptor_pb2.DescriptorProto, scope: str) -> None:
        message.name = self.take()
        full = f"{scope}.{message.name}"
        self.kinds[full] = _TYPE_MESSAGE
        self.take("{")
        while self.peek() != "}":
            token = self.peek()
            if token == "message":
                self.take()
                self.message(message.nested_type.add(), full)
            elif token == "enum":
                self.take()
                self.enum(message.enum_type.add(), full)
            elif token == "oneof":
                self.take()
                index = len(message.oneof_decl)
                message.oneof_decl.add(name=self.take())
                self.take("{")
                while self.peek() != "}":
                    self.field(message, full, oneof_index=index)
                self.take("}")
            elif token == "map":
                self.map_field(message, full)
            else:
                self.field(message, full)
        self.take("}")

    def field(self, message: descriptor_pb2.DescriptorProto, scope: str, oneof_index: int | None = None) -> None:
        label = _LABEL_OPTIONAL
        if self.peek() == "repeated":
            self.take()
            label = _LABEL_REPEATED
        type_name = self.take()
        field = message.field.add(name=self.take(), label=label)
        self.take("=")
        field.number = int(self.take())
        self.take(";")
        if oneof_index is not None:
            field.oneof_index = oneof_index
        if type_name in _SCALARS:
            field.type = _SCALARS[type_name]
        else:
            self.pending.append((field, type_name, scope))

    def map_field(self, message: descriptor_pb2.DescriptorProto, scope: str) -> None:
        # map<K, V> name = N;  is  repeated NameEntry name = N;  with a nested map-entry message.
        self.take("map")
        self.take("<")
        key_type = self.take()
        self.take(",")
        value_type = self.take()
        self.take(">")
        name = self.take()
        self.take("=")
        number = int(self.take())
        self.take(";")
        entry_name = "".join(part[:1].upper() + part[1:] for part in name.split("_")) + "Entry"
        entry = message.nested_type.add(name=entry_name)
        entry.options.map_entry = True
        entry_full = f"{scope}.{entry_name}"
        self.kinds[entry_full] = _TYPE_MESSAGE
        key = entry.field.add(name="key", number=1, label=_LABEL_OPTIONAL, type=_SCALARS[key_type])
        value = entry.field.add(name="value", number=2, label=_LABEL_OPTIONAL)
        del key
        if value_type in _SCALARS:
            value.type = _SCALARS[value_type]
        else:
            self.pending.append((value, value_type, entry_full))
        message.field.add(name=name, number=number, label=_LABEL_REPEATED, type=_TYPE_MESSAGE, type_name=entry_full)


def parse_proto(text: str, filename: str = "sgdfuse/lowering/ge_ir.proto") -> descriptor_pb2.FileDescriptorProto:
    """Parse proto3 ``text`` (the subset ``ge_ir.proto`` uses) into a ``FileDescriptorProto``.

    Raises:
        ProtoSyntaxError: a construct outside that subset, or an unknown type name.
    """
    return _Parser(text, filename).parse()


PROTO_SOURCE: str = resources.files("sgdfuse.lowering").joinpath("ge_ir.proto").read_text(encoding="utf-8")
"""The text of ``ge_ir.proto``."""

FILE_DESCRIPTOR: descriptor_pb2.FileDescriptorProto = parse_proto(PROTO_SOURCE)
"""``ge_ir.proto`` as a ``FileDescriptorProto``."""

_POOL = descriptor_pool.DescriptorPool()
_POOL.AddSerializedFile(FILE_DESCRIPTOR.SerializeToString())


def _message_class(name: str):
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"{FILE_DESCRIPTOR.package}.{name}"))


ModelDef = _message_class("ModelDef")
GraphDef = _message_class("GraphDef")
OpDef = _message_class("OpDef")
AttrDef = _message_class("AttrDef")
NamedAttrs = _message_class("NamedAttrs")
ShapeDef = _message_class("ShapeDef")
TensorDescriptor = _message_class("TensorDescriptor")
TensorDef = _message_class("TensorDef")

DataType = _POOL.FindEnumTypeByName(f"{FILE_DESCRIPTOR.package}.DataType")
"""The ``DataType`` enum descriptor (``DataType.values_by_name["DT_FLOAT"].number == 1``)."""

GE_DTYPE_NAMES: dict[int, str] = {value.number: value.name for value in DataType.values}
"""Proto ``DataType`` number → name (``1 → "DT_FLOAT"``); the names are also GE's serial strings used in the
``origin_data_type`` descriptor attribute."""

ONNX_TO_GE_DTYPE: dict[int, int] = {
    TensorProto.FLOAT: 1,
    TensorProto.UINT8: 4,
    TensorProto.INT8: 3,
    TensorProto.UINT16: 6,
    TensorProto.INT16: 5,
    TensorProto.INT32: 7,
    TensorProto.INT64: 8,
    TensorProto.STRING: 13,
    TensorProto.BOOL: 11,
    TensorProto.FLOAT16: 2,
    TensorProto.DOUBLE: 12,
    TensorProto.UINT32: 9,
    TensorProto.UINT64: 10,
    TensorProto.COMPLEX64: 16,
    TensorProto.COMPLEX128: 17,
    TensorProto.BFLOAT16: 27,
}
"""ONNX ``TensorProto.DataType`` → proto ``DataType`` (for ``TensorDescriptor.dtype``)."""

ONNX_TO_GE_CPP_DTYPE: dict[int, int] = {
    TensorProto.FLOAT: 0,
    TensorProto.FLOAT16: 1,
    TensorProto.INT8: 2,
    TensorProto.INT32: 3,
    TensorProto.UINT8: 4,
    TensorProto.INT16: 6,
    TensorProto.UINT16: 7,
    TensorProto.UINT32: 8,
    TensorProto.INT64: 9,
    TensorProto.UINT64: 10,
    TensorProto.DOUBLE: 11,
    TensorProto.BOOL: 12,
    TensorProto.BFLOAT16: 27,
}
"""ONNX ``TensorProto.DataType`` → C++ ``ge::DataType`` (for ``AttrDef.dt`` and dtype-valued int attributes
such as ``Cast.dst_type`` and ``Shape.dtype``)."""


def ge_dtype(onnx_dtype: int) -> int:
    """The proto ``DataType`` number of an ONNX element type; ``DT_UNDEFINED`` (0) when it has none."""
    return ONNX_TO_GE_DTYPE.get(onnx_dtype, 0)


def ge_cpp_dtype(onnx_dtype: int) -> int | None:
    """The C++ ``ge::DataType`` number of an ONNX element type, or None when GE has none for it here."""
    return ONNX_TO_GE_CPP_DTYPE.get(onnx_dtype)

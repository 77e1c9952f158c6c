"""JSON rendering of GE IR messages in the layout of ATC's model-to-JSON mode (``atc --mode=1``).

Layout (facts about ATC's ``Pb2Json``, from the public converter source and docs/lowering.md; the code
here is written from those facts):

- keys are proto field names; objects print with sorted keys (ATC's JSON objects are ordered maps);
- a repeated field appears only when non-empty, as an array; a singular field only when set (proto3: a
  non-default scalar, a set ``oneof`` member, a non-empty message);
- enums print as their names (``"dtype": "DT_FLOAT"``);
- a map (``attr``) prints as an array of ``{"key": ..., "value": {...}}`` entries (sorted by key here);
- a singular ``float`` prints as a string formatted with ``%g`` (``"f": "0.25"``); repeated floats are
  numbers; bytes print as text;
- fields named in ATC's black list are left out everywhere (:data:`ATC_OMITTED_FIELDS`; they include
  ``data``, so ``Const`` values are not printed, and ``output``, so ``GraphDef.output`` is not either).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Collection, Iterator

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

__all__ = ["ATC_OMITTED_FIELDS", "message_json_pieces", "message_to_dict", "message_to_json"]

ATC_OMITTED_FIELDS: frozenset[str] = frozenset(
    {"output", "data_offset", "data", "workspace", "workspace_bytes", "memory_size", "weight_size", "size", "bt", "quantize_factor"}
)
"""Field names ATC leaves out of its JSON (its ``kOmBlackFields``)."""


def _scalar(field: FieldDescriptor, value: object, *, repeated: bool) -> object:
    if field.type == FieldDescriptor.TYPE_ENUM:
        enum_value = field.enum_type.values_by_number.get(value)  # type: ignore[arg-type]
        return enum_value.name if enum_value is not None else value
    if field.type == FieldDescriptor.TYPE_FLOAT:
        return float(value) if repeated else "%g" % value  # type: ignore[str-format]
    if field.type == FieldDescriptor.TYPE_BYTES:
        try:
            return bytes(value).decode("utf-8")  # type: ignore[arg-type]
        except UnicodeDecodeError:  # only reachable with omit=() on tensor data
            return "base64:" + base64.b64encode(bytes(value)).decode()  # type: ignore[arg-type]
    return value


def _is_repeated(field: FieldDescriptor) -> bool:
    # protobuf >= 6 has ``is_repeated`` (``label`` is gone in 7); older runtimes only ``label``.
    flag = getattr(field, "is_repeated", None)
    return bool(flag) if flag is not None else field.label == FieldDescriptor.LABEL_REPEATED


def _is_map(field: FieldDescriptor) -> bool:
    return field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


def message_to_dict(message: Message, *, omit: Collection[str] = ATC_OMITTED_FIELDS) -> dict:
    """``message`` as ATC's JSON layout (a ``dict`` ready for :func:`json.dumps`)."""
    result: dict = {}
    for field in message.DESCRIPTOR.fields:
        if field.name in omit:
            continue
        value = getattr(message, field.name)
        if _is_map(field):
            if len(value):
                value_field = field.message_type.fields_by_name["value"]
                entries = []
                for key in sorted(value):
                    item = value[key]
                    if value_field.type == FieldDescriptor.TYPE_MESSAGE:
                        rendered = message_to_dict(item, omit=omit)
                    else:
                        rendered = _scalar(value_field, item, repeated=False)
                    entries.append({"key": key, "value": rendered})
                result[field.name] = entries
            continue
        if _is_repeated(field):
            if len(value):
                if field.type == FieldDescriptor.TYPE_MESSAGE:
                    result[field.name] = [message_to_dict(item, omit=omit) for item in value]
                else:
                    result[field.name] = [_scalar(field, item, repeated=True) for item in value]
            continue
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if message.HasField(field.name) and value.ByteSize():
                result[field.name] = message_to_dict(value, omit=omit)
            continue
        present = message.HasField(field.name) if field.containing_oneof is not None else value != field.default_value
        if present:
            result[field.name] = _scalar(field, value, repeated=False)
    return result


def message_to_json(message: Message, *, omit: Collection[str] = ATC_OMITTED_FIELDS, indent: int | None = 2) -> str:
    """``message`` as JSON text in ATC's layout (sorted keys): exactly
    ``json.dumps(message_to_dict(message, omit=omit), indent=indent, sort_keys=True, ensure_ascii=False)``.

    With an ``indent`` (an int of spaces), the text is written by :func:`message_json_pieces`, joined."""
    if indent is None or type(indent) is not int:
        return json.dumps(message_to_dict(message, omit=omit), indent=indent, sort_keys=True, ensure_ascii=False)
    return "".join(message_json_pieces(message, omit=omit, indent=indent))


def message_json_pieces(message: Message, *, omit: Collection[str] = ATC_OMITTED_FIELDS, indent: int = 2) -> Iterator[str]:
    """The text of :func:`message_to_json` (``indent`` spaces a level) in pieces, one per item of a repeated
    top-level field (a ``GraphDef`` each) and, inside a graph, one per op, so a large model is written
    to a file without holding its whole JSON (about 6 KB an op) as one string.

    It is written from the message here rather than through :func:`message_to_dict` and :func:`json.dumps`
    (whose indented writer is Python, a generator per container: 9 minutes for a 300,000-op graph). Every
    field is rendered by the rules of :func:`message_to_dict`; a sub-message's text is kept by its
    deterministic wire bytes (equal bytes are equal field values, so equal text), and the text of a
    shallower copy gains the deeper indent by inserting it after each line break (JSON text has line breaks
    only between items). tests/test_lowering_json.py holds the text to ``json.dumps``'s.
    """
    writer = _Writer(frozenset(omit), " " * indent)
    yield from writer.pieces(message)


_FLOAT = FieldDescriptor.TYPE_FLOAT
_DOUBLE = FieldDescriptor.TYPE_DOUBLE
_BOOL = FieldDescriptor.TYPE_BOOL
_ENUM = FieldDescriptor.TYPE_ENUM
_BYTES = FieldDescriptor.TYPE_BYTES
_STRING = FieldDescriptor.TYPE_STRING
_MESSAGE = FieldDescriptor.TYPE_MESSAGE
_encode_string = json.encoder.encode_basestring  # what json.dumps writes a str with (ensure_ascii=False)


def _float_text(value: float) -> str:
    # json.encoder's floatstr with allow_nan (json.dumps's default).
    if value != value:
        return "NaN"
    if value == _INFINITY:
        return "Infinity"
    if value == -_INFINITY:
        return "-Infinity"
    return float.__repr__(value)


_INFINITY = float("inf")


class _Writer:
    """The JSON text of messages in ATC's layout, at any depth (see :func:`message_json_pieces`)."""

    def __init__(self, omit: frozenset[str], step: str) -> None:
        self.omit = omit
        self.step = step
        self.fields: dict[object, tuple] = {}  # message descriptor -> its fields' renderings
        self.texts: dict[tuple[object, bytes], str] = {}  # (descriptor, wire bytes) -> text at depth 0

    def pieces(self, message: Message) -> Iterator[str]:
        """:meth:`text` of ``message`` at depth 0, in pieces: a top-level repeated message field item by item,
        and the ``op`` items of a ``GraphDef`` one by one."""
        entries = self._entries(message, 0, deep=True)
        if not entries:
            yield "{}"
            return
        step = self.step
        yield "{"
        for n, (key, value) in enumerate(entries):
            yield ("\n" if n == 0 else ",\n") + step + key + ": "
            yield from value if type(value) is not str else (value,)
        yield "\n}"

    def text(self, message: Message, depth: int) -> str:
        """The JSON text of ``message`` (as :func:`message_to_dict` renders it, then ``json.dumps``) written
        ``depth`` levels deep in an indented document."""
        key = (message.DESCRIPTOR, message.SerializeToString(deterministic=True))
        text = self.texts.get(key)
        if text is None:
            text = self.texts[key] = self._object(self._entries(message, 0, deep=False), 0)
        return text.replace("\n", "\n" + self.step * depth) if depth and "\n" in text else text

    def _object(self, entries: list, depth: int) -> str:
        if not entries:
            return "{}"
        inner = "\n" + self.step * (depth + 1)
        return "{" + inner + ("," + inner).join([key + ": " + value for key, value in entries]) + "\n" + self.step * depth + "}"

    def _array(self, items: list[str], depth: int) -> str:
        inner = "\n" + self.step * (depth + 1)
        return "[" + inner + ("," + inner).join(items) + "\n" + self.step * depth + "]"

    def _renderings(self, descriptor) -> tuple:
        known = self.fields.get(descriptor)
        if known is None:
            known = []
            for field in descriptor.fields:
                if field.name in self.omit:
                    continue
                if _is_map(field):
                    kind = "map"
                elif _is_repeated(field):
                    kind = "repeated"
                elif field.type == _MESSAGE:
                    kind = "message"
                else:
                    kind = "oneof" if field.containing_oneof is not None else "scalar"
                known.append((field, kind, _encode_string(field.name)))
            known.sort(key=lambda entry: entry[0].name)  # json.dumps(sort_keys=True)
            known = self.fields[descriptor] = tuple(known)
        return known

    def _entries(self, message: Message, depth: int, *, deep: bool) -> list:
        """``(encoded key, text)`` of the fields :func:`message_to_dict` keeps, in key order, ``depth`` levels
        deep. With ``deep`` (the top level and a ``GraphDef``), a repeated message field's text is a generator
        of pieces rather than one string."""
        entries = []
        for field, kind, key in self._renderings(message.DESCRIPTOR):
            value = getattr(message, field.name)
            if kind == "scalar":
                if value != field.default_value:
                    entries.append((key, self._scalar(field, value, repeated=False)))
            elif kind == "oneof":
                if message.HasField(field.name):
                    entries.append((key, self._scalar(field, value, repeated=False)))
            elif kind == "message":
                if message.HasField(field.name) and value.ByteSize():
                    entries.append((key, self.text(value, depth + 1)))
            elif kind == "repeated":
                if len(value):
                    if field.type != _MESSAGE:
                        entries.append((key, self._array([self._scalar(field, item, repeated=True) for item in value], depth + 1)))
                    elif deep:
                        entries.append((key, self._items(value, depth + 1)))
                    else:
                        entries.append((key, self._array([self.text(item, depth + 2) for item in value], depth + 1)))
            elif len(value):  # a map: {"key": ..., "value": ...} entries sorted by key
                value_field = field.message_type.fields_by_name["value"]
                key_field = field.message_type.fields_by_name["key"]
                items = []
                inner = "\n" + self.step * (depth + 3)
                for map_key in sorted(value):
                    item = value[map_key]
                    rendered = self.text(item, depth + 3) if value_field.type == _MESSAGE else self._scalar(value_field, item, repeated=False)
                    items.append("{" + inner + '"key": ' + self._scalar(key_field, map_key, repeated=False) + "," + inner + '"value": ' + rendered
                                 + "\n" + self.step * (depth + 2) + "}")
                entries.append((key, self._array(items, depth + 1)))
        return entries

    def _items(self, items, depth: int) -> Iterator[str]:
        """A repeated message field's array ``depth`` levels deep, in pieces: a ``GraphDef`` item's ops one by one."""
        inner = "\n" + self.step * (depth + 1)
        yield "["
        for n, item in enumerate(items):
            yield ("" if n == 0 else ",") + inner
            if item.DESCRIPTOR.name == "GraphDef":
                entries = self._entries(item, depth + 1, deep=True)
                if not entries:
                    yield "{}"
                    continue
                field_inner = "\n" + self.step * (depth + 2)
                yield "{"
                for k, (key, value) in enumerate(entries):
                    yield ("" if k == 0 else ",") + field_inner + key + ": "
                    yield from value if type(value) is not str else (value,)
                yield "\n" + self.step * (depth + 1) + "}"
            else:  # an op: its text is its own (its name), so it is not kept; its parts are
                yield self._object(self._entries(item, depth + 1, deep=False), depth + 1)
        yield "\n" + self.step * depth + "]"

    @staticmethod
    def _scalar(field: FieldDescriptor, value: object, *, repeated: bool) -> str:
        # The text json.dumps writes for _scalar(field, value, repeated=repeated).
        kind = field.type
        if kind == _STRING:
            return _encode_string(value)
        if kind == _FLOAT:
            return _float_text(float(value)) if repeated else _encode_string("%g" % value)
        if kind == _DOUBLE:
            return _float_text(value)
        if kind == _BOOL:
            return "true" if value else "false"
        if kind == _ENUM:
            enum_value = field.enum_type.values_by_number.get(value)
            return _encode_string(enum_value.name) if enum_value is not None else int.__repr__(value)
        if kind == _BYTES:
            rendered = _scalar(field, value, repeated=repeated)
            return _encode_string(rendered)
        return int.__repr__(value)

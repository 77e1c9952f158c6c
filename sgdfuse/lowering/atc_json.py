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
from collections.abc import Collection

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

__all__ = ["ATC_OMITTED_FIELDS", "message_to_dict", "message_to_json"]

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
    """``message`` as JSON text in ATC's layout (sorted keys)."""
    return json.dumps(message_to_dict(message, omit=omit), indent=indent, sort_keys=True, ensure_ascii=False)

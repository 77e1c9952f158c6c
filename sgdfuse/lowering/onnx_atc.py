"""``--format onnx-atc``: a fused ONNX model prepared for ATC's own ONNX parser, plus the op plugin source.

For users who convert ONNX with ATC (``atc --framework=5``) themselves. Facts used, from the public source of
ATC's ONNX parser (``parser/onnx/onnx_parser.cc``, ``parser/common/convert/pb2json.cc`` and
``message2operator.cc``) and of metadef's ``register.h``; docs/atc.md says what is relied on and why:

- ATC looks an op up by ``<domain>::<opset version>::<op_type>``, an empty domain read as ``ai.onnx``; a
  custom domain works when an op plugin registers exactly that key and the domain is in ``opset_import``.
  The fused op's key is :data:`ATC_OP_KEY` = ``"ai.sgdfuse::1::SGD"``.
- Standard nodes keep the default domain written as ``""`` (as exporters write it), so that
  ``onnx.checker`` accepts the model. ATC's parser resolves an empty domain only when ``opset_import`` has a
  single entry; ``explicit_onnx_domain=True`` writes ``ai.onnx`` on every standard node instead, for parsers
  that refuse the mix (the checker then refuses the model: it knows no ``ai.onnx`` domain on nodes).
- The parser reads ``graph`` and ``opset_import`` only: the model-local ``FunctionProto`` of the fused op is
  dropped (ATC would ignore it; the plugin replaces it).
- ATC hands a plugin the node's attributes as JSON in which a FLOAT is text written with ``%g`` (six
  significant digits), so each ``SGD`` node also carries ``dampening_bits`` and ``weight_decay_bits``: INT
  attributes holding the IEEE-754 binary32 bit pattern of the float, which the plugin reads exactly
  (:data:`BITS_SUFFIX`).

The plugin (:func:`plugin_source`, C++ text to build as a CANN ONNX framework plugin; not compiled here)
registers the key. The ONNX node has three outputs while GE's ``SGD`` declares one and writes ``accum`` and
``stat`` in place, so the key is registered as a ``PartitionedCall`` whose subgraph is ``Data x6 → SGD``,
with output 0 the ``SGD`` op's ``parameters`` and outputs 1 and 2 ``TensorMove`` copies of ``accum`` and
``stat`` taken after it (control edges): the semantics of the ``.air`` lowering (:mod:`sgdfuse.lowering.state`).
Its attribute reader (:func:`attribute_reader_source`) depends on nlohmann's JSON and the C++ standard
library only, so it can be compiled and tested alone.
"""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path

import onnx
from onnx import helper

import sgdfuse
from sgdfuse.contract import product_line_for_soc
from sgdfuse.fused_op import DOMAIN, OP_TYPE, OP_VERSION, is_sgd_node, read_sgd_attributes
from sgdfuse.external_data import normalised_locations
from sgdfuse.output import OutputBatch
from sgdfuse.lowering.lower import prepare
from sgdfuse.lowering.soc import check_product_line
from sgdfuse.passes.index import build_index

__all__ = [
    "ATC_OP_KEY",
    "STANDARD_DOMAIN",
    "BITS_SUFFIX",
    "float32_bits",
    "to_onnx_atc",
    "plugin_source",
    "attribute_reader_source",
    "plugin_path_for",
    "write_onnx_atc",
]

logger = logging.getLogger(__name__)

STANDARD_DOMAIN = "ai.onnx"
"""The default domain's explicit name (written on standard nodes only with ``explicit_onnx_domain``)."""

ATC_OP_KEY = f"{DOMAIN}::{OP_VERSION}::{OP_TYPE}"
"""The key ATC's ONNX parser computes for the fused node: ``ai.sgdfuse::1::SGD``."""

BITS_SUFFIX = "_bits"
"""``<float attribute><BITS_SUFFIX>``: an INT attribute with the float32 bit pattern of that FLOAT attribute
(``dampening_bits``, ``weight_decay_bits``), the exact value the plugin uses."""

_FLOAT_ATTRIBUTES = ("dampening", "weight_decay")


def float32_bits(value: float) -> int:
    """The IEEE-754 binary32 bit pattern of ``value`` rounded to float32, as an unsigned int (0 .. 2**32-1).

    ONNX stores a FLOAT attribute as float32, so for an attribute's value this is exact.
    """
    return struct.unpack("<I", struct.pack("<f", value))[0]


def _set_domains(graph: onnx.GraphProto, *, explicit: bool) -> None:
    """Standard nodes (and those of subgraphs) get ``""`` or, with ``explicit``, ``ai.onnx``."""
    for node in graph.node:
        if node.domain in ("", STANDARD_DOMAIN):
            node.domain = STANDARD_DOMAIN if explicit else ""
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                _set_domains(attribute.g, explicit=explicit)
            for sub in attribute.graphs:
                _set_domains(sub, explicit=explicit)


def _set_opset_domains(model: onnx.ModelProto, *, explicit: bool) -> None:
    """One entry for the default domain, named ``""`` or (``explicit``) ``ai.onnx``; the highest version wins
    when the input lists both spellings."""
    default_versions = [e.version for e in model.opset_import if e.domain in ("", STANDARD_DOMAIN)]
    others = [(e.domain, e.version) for e in model.opset_import if e.domain not in ("", STANDARD_DOMAIN)]
    del model.opset_import[:]
    if default_versions:
        model.opset_import.add(domain=STANDARD_DOMAIN if explicit else "", version=max(default_versions))
    for domain, version in others:
        model.opset_import.add(domain=domain, version=version)


def _sgd_attributes_for_atc(node: onnx.NodeProto) -> None:
    """Rewrite an ``SGD`` node's attributes as the plugin reads them: ``dampening``, ``weight_decay``
    (FLOAT), ``nesterov`` (INT 0/1), always present (contract defaults filled in), then ``dampening_bits`` and
    ``weight_decay_bits`` (INT, the float32 bit patterns).

    Raises:
        AttributeContractError: the attributes break the contract (a non-finite ``dampening``, say).
    """
    attributes = read_sgd_attributes(node)
    attributes.check(subject=node.name or OP_TYPE)
    values = {"dampening": attributes.dampening, "weight_decay": attributes.weight_decay}
    del node.attribute[:]
    for name in _FLOAT_ATTRIBUTES:
        node.attribute.append(helper.make_attribute(name, float(values[name]), attr_type=onnx.AttributeProto.FLOAT))
    node.attribute.append(helper.make_attribute("nesterov", int(attributes.nesterov), attr_type=onnx.AttributeProto.INT))
    for name in _FLOAT_ATTRIBUTES:
        # make_attribute stored the value as float32 above: the bits are those of that stored value
        stored = next(a.f for a in node.attribute if a.name == name)
        node.attribute.append(helper.make_attribute(name + BITS_SUFFIX, float32_bits(stored), attr_type=onnx.AttributeProto.INT))


def to_onnx_atc(
    model: str | os.PathLike | onnx.ModelProto, *, soc: str, optimise: bool = True, explicit_onnx_domain: bool = False
) -> onnx.ModelProto:
    """The ATC-ready ONNX model (a new ``ModelProto``; the input is not mutated).

    The fused ``SGD`` nodes are checked against ``soc``'s product line first, as :func:`sgdfuse.lower` does;
    a model without them is optimised first unless ``optimise`` is False. Standard nodes are in the default
    domain written ``""`` (the model passes ``onnx.checker``), or ``ai.onnx`` with ``explicit_onnx_domain``
    (for ATC parsers that refuse ``""`` beside a custom domain; the checker refuses that form).

    Raises:
        ProductLineError: unknown ``soc``, or an ``SGD`` node the product line cannot run.
        AttributeContractError: an ``SGD`` node's attributes break the contract.
    """
    line = product_line_for_soc(soc)
    source, _ = prepare(model, optimise=optimise)
    result = onnx.ModelProto()
    result.CopyFrom(source)
    # The default domain as "" first: ONNX shape inference, which the product-line check reads, knows no
    # "ai.onnx" on nodes (an input already written with explicit domains is accepted too).
    _set_domains(result.graph, explicit=False)
    _set_opset_domains(result, explicit=False)
    index = build_index(result)
    check_product_line(index, [k for k, node in enumerate(result.graph.node) if is_sgd_node(node)], line)
    if explicit_onnx_domain:
        _set_domains(result.graph, explicit=True)
        _set_opset_domains(result, explicit=True)
    sgd_nodes = [n for n in result.graph.node if is_sgd_node(n)]
    for node in sgd_nodes:
        _sgd_attributes_for_atc(node)
    for entry in result.opset_import:
        if entry.domain == DOMAIN:
            entry.version = OP_VERSION  # the version is part of the key the plugin registers
    if sgd_nodes and not any(e.domain == DOMAIN for e in result.opset_import):
        result.opset_import.add(domain=DOMAIN, version=OP_VERSION)
    del result.functions[:]
    # ATC maps the node by its key alone; with the functions gone, a specialised body's overload name means
    # nothing there.
    for node in result.graph.node:
        if is_sgd_node(node):
            node.ClearField("overload")
    logger.info("prepared %d SGD node(s) for ATC (standard domain written %r)", len(sgd_nodes), STANDARD_DOMAIN if explicit_onnx_domain else "")
    return result


def plugin_path_for(model_path: str | os.PathLike) -> Path:
    """Where the plugin source goes beside an ONNX-ATC model: ``<stem>.sgd_onnx_plugin.cc``."""
    path = Path(model_path)
    stem = path.name[: -len(".onnx")] if path.name.endswith(".onnx") else path.name
    return path.with_name(f"{stem}.sgd_onnx_plugin.cc")


def write_onnx_atc(
    model: str | os.PathLike | onnx.ModelProto,
    path: str | os.PathLike,
    *,
    soc: str,
    optimise: bool = True,
    explicit_onnx_domain: bool = False,
) -> tuple[Path, Path]:
    """Write the ATC-ready model to ``path`` and the plugin source beside it (both atomically); ``optimise``
    and ``explicit_onnx_domain`` as for :func:`to_onnx_atc`.

    Returns:
        ``(model path, plugin source path)``.
    """
    # A path is loaded with its external data (checked); a ModelProto may still name data files, and none
    # that escapes the output's directory is written.
    prepared = normalised_locations(
        to_onnx_atc(model, soc=soc, optimise=optimise, explicit_onnx_domain=explicit_onnx_domain), path
    )
    plugin = plugin_path_for(path)
    with OutputBatch() as batch:  # the model and its plugin source together or not at all
        batch.stage(path, prepared.SerializeToString())
        batch.stage(plugin, plugin_source().encode())
        batch.commit()
    return Path(path), plugin


def attribute_reader_source() -> str:
    """C++ source of the plugin's attribute reader, ``sgdfuse_atc::ReadSgdAttributes`` (part of
    :func:`plugin_source`): it turns the JSON ATC's parser passes as the node's ``"attribute"`` into the
    three GE attributes, or into an error message; it needs nlohmann's ``json.hpp`` (included by the caller)
    and the C++ standard library only. The encodings it accepts are listed in its leading comment."""
    return _READER


def plugin_source(key: str = ATC_OP_KEY) -> str:
    """C++ source of the ATC ONNX op plugin mapping ``key`` to GE ``SGD`` (see the module docstring)."""
    return (
        _PLUGIN_HEAD.replace("@KEY@", key).replace("@VERSION@", sgdfuse.__version__)
        + _READER
        + _PLUGIN_GE.replace("@KEY@", key)
    )


_PLUGIN_HEAD = r"""// Generated by sgdfuse @VERSION@ (`sgdfuse lower --format onnx-atc`). Do not edit; regenerate.
//
// ATC ONNX parser plugin for the fused momentum-SGD op "@KEY@" (domain ai.sgdfuse, version 1):
// inputs  parameters, gradient, learning_rate, accum, momentum, stat   (the Ascend SGD contract order)
// outputs parameters_out, accum_out, stat_out
// attrs   dampening, weight_decay (FLOAT), nesterov (INT 0/1), and dampening_bits, weight_decay_bits (INT:
//         the float32 bit patterns of the two FLOATs, the exact values used)
//
// GE's SGD op declares one output, `parameters` (a ref of its input), and writes accum and stat in place.
// The ONNX node is therefore mapped to a PartitionedCall whose subgraph is
//     Data x6 -> SGD;  output 0 = SGD:0;  outputs 1, 2 = TensorMove(accum), TensorMove(stat) after SGD
// (control edges), i.e. copies of accum and stat taken after the in-place update.
//
// Build as the ONNX framework plugin of a CANN custom op project (framework/onnx_plugin), against the CANN
// headers register/register.h, graph/operator.h, graph/graph.h, the GE op prototypes (all_ops.h) and
// nlohmann's json.hpp (C++11 or later). CANN API used: REGISTER_CUSTOM_OP and OpRegistrationData,
// AutoMappingByOpFnDynamic with DynamicInputOutputInfo (register.h), ge::Operator's public GetName, GetAttr,
// SetAttr and AddControlInput, ge::Graph's SetInputs and SetOutputs; no protected member of ge::Operator.

#include "register/register.h"
#include "graph/operator.h"
#include "graph/graph.h"
#include "all_ops.h"
#include "json.hpp"
"""

_READER = r"""
// ---- The SGD node's ONNX attributes, as ATC's ONNX parser passes them ----------------------------------
//
// ATC hands a plugin the node's AttributeProto list as the string attribute "attribute" of op_src:
//     {"attribute": [{"name": "dampening", "type": 1, "f": "0.1"}, {"name": "nesterov", "type": 2}, ...]}
// Encodings met in the public parser versions (parser/common/convert/pb2json.cc, message2operator.cc):
//   type  the AttributeType number (FLOAT = 1, INT = 2); the names "FLOAT" and "INT" are accepted too;
//   f     FLOAT: text written with printf "%g" (6 significant digits) when it fits in 9 characters; when it
//         does not, a JSON number (newer parsers) or "" (older ones);
//   i     INT: a JSON integer;
//   a zero f or i may be left out (proto3 leaves out a field equal to its default; newer parsers write it).
// "%g" rounds float32 values, so sgdfuse also writes each FLOAT's bit pattern as the INT "<name>_bits": that
// is the value used, and f must agree with it as closely as its encoding allows (exactly for a number or a
// left-out zero, to 1e-5 relative for text; "" carries nothing to compare).
// Every problem (malformed JSON, a missing, unknown, repeated or mistyped attribute, a value out of range)
// comes back as a message naming the attribute; nothing throws out of ReadSgdAttributes.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <iomanip>
#include <limits>
#include <locale>
#include <sstream>
#include <string>

namespace sgdfuse_atc {

struct SgdAttributes {
  float dampening = 0.0f;
  float weight_decay = 0.0f;
  bool nesterov = false;
};

namespace detail {

using Json = nlohmann::json;

constexpr int64_t kOnnxFloat = 1;  // onnx.AttributeProto.FLOAT
constexpr int64_t kOnnxInt = 2;    // onnx.AttributeProto.INT

enum Slot { kDampening, kWeightDecay, kNesterov, kDampeningBits, kWeightDecayBits, kSlots };
constexpr const char *kNames[kSlots] = {"dampening", "weight_decay", "nesterov", "dampening_bits",
                                        "weight_decay_bits"};
constexpr int64_t kTypes[kSlots] = {kOnnxFloat, kOnnxFloat, kOnnxInt, kOnnxInt, kOnnxInt};

// How the FLOAT's "f" arrived.
enum class FloatForm { kLeftOut, kNumber, kText, kEmptyText };

inline std::string Decimal(double value) {  // for messages: 9 significant digits, any locale
  std::ostringstream out;
  out.imbue(std::locale::classic());
  out << std::setprecision(9) << value;
  return out.str();
}

inline bool HasType(const Json &item, int64_t expected) {
  const auto type = item.find("type");
  if (type == item.end()) {
    return false;
  }
  if (type->is_number_integer()) {
    return type->get<int64_t>() == expected;
  }
  if (type->is_string()) {
    return type->get<std::string>() == (expected == kOnnxFloat ? "FLOAT" : "INT");
  }
  return false;
}

// The INT value "i"; a left-out "i" is 0.
inline bool ReadInt(const Json &item, const char *name, int64_t &value, std::string &error) {
  const auto field = item.find("i");
  if (field == item.end()) {
    value = 0;
    return true;
  }
  if (field->is_number_unsigned()) {
    const uint64_t unsigned_value = field->get<uint64_t>();
    if (unsigned_value > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      error = std::string("attribute ") + name + ": \"i\" is " + field->dump() + ", past the int64 range";
      return false;
    }
    value = static_cast<int64_t>(unsigned_value);
    return true;
  }
  if (field->is_number_integer()) {
    value = field->get<int64_t>();
    return true;
  }
  error = std::string("attribute ") + name + ": \"i\" is " + field->dump() + ", not an integer";
  return false;
}

// A finite decimal number written by printf "%g", read in the C locale whatever the process locale is.
inline bool ParseDecimal(const std::string &text, double &value) {
  std::istringstream in(text);
  in.imbue(std::locale::classic());
  in >> value;
  return !in.fail() && in.peek() == std::char_traits<char>::eof() && std::isfinite(value);
}

// The FLOAT value "f" in any of its encodings; a left-out "f" is 0.
inline bool ReadFloat(const Json &item, const char *name, double &value, FloatForm &form, std::string &error) {
  const auto field = item.find("f");
  value = 0.0;
  if (field == item.end()) {
    form = FloatForm::kLeftOut;
    return true;
  }
  if (field->is_number()) {
    value = field->get<double>();
    form = FloatForm::kNumber;
    return true;
  }
  if (field->is_string()) {
    const std::string text = field->get<std::string>();
    if (text.empty()) {
      form = FloatForm::kEmptyText;
      return true;
    }
    if (ParseDecimal(text, value)) {
      form = FloatForm::kText;
      return true;
    }
    error = std::string("attribute ") + name + ": \"f\" is " + field->dump() + ", not a finite decimal number";
    return false;
  }
  error = std::string("attribute ") + name + ": \"f\" is " + field->dump() + ", neither a number nor text";
  return false;
}

// The float whose IEEE-754 binary32 bit pattern is bits.
inline bool FloatFromBits(int64_t bits, const char *name, float &value, std::string &error) {
  if (bits < 0 || bits > 0xFFFFFFFFLL) {
    error = std::string("attribute ") + name + " is " + std::to_string(bits) +
            ", not a float32 bit pattern (0 to 4294967295)";
    return false;
  }
  const uint32_t pattern = static_cast<uint32_t>(bits);
  std::memcpy(&value, &pattern, sizeof value);
  if (!std::isfinite(value)) {
    error = std::string("attribute ") + name + " is " + std::to_string(bits) +
            ", the bit pattern of a non-finite float";
    return false;
  }
  return true;
}

inline bool Agrees(float exact, double encoded, FloatForm form) {
  const double value = static_cast<double>(exact);
  switch (form) {
    case FloatForm::kLeftOut:
    case FloatForm::kNumber:
      return value == encoded;
    case FloatForm::kText:  // "%g" keeps 6 significant digits: a relative error of at most 5e-6
      return std::fabs(value - encoded) <= 1e-5 * std::max(std::fabs(value), std::fabs(encoded));
    case FloatForm::kEmptyText:
      return true;
  }
  return false;
}

inline bool ReadFrom(const Json &document, SgdAttributes &attributes, std::string &error) {
  if (!document.is_object()) {
    error = "the attribute JSON is not an object";
    return false;
  }
  const auto list = document.find("attribute");
  if (list == document.end() || !list->is_array()) {
    error = "the attribute JSON has no \"attribute\" array";
    return false;
  }
  const Json *items[kSlots] = {};
  for (const auto &item : *list) {
    if (!item.is_object()) {
      error = "an entry of \"attribute\" is not an object";
      return false;
    }
    const auto name = item.find("name");
    if (name == item.end() || !name->is_string()) {
      error = "an entry of \"attribute\" has no name";
      return false;
    }
    const std::string text = name->get<std::string>();
    int slot = 0;
    while (slot < kSlots && text != kNames[slot]) {
      ++slot;
    }
    if (slot == kSlots) {
      error = "unknown attribute " + Json(text).dump() +
              " (this plugin reads dampening, weight_decay, nesterov, dampening_bits and weight_decay_bits)";
      return false;
    }
    if (items[slot] != nullptr) {
      error = "attribute " + text + " appears twice";
      return false;
    }
    if (!HasType(item, kTypes[slot])) {
      const auto type = item.find("type");
      error = "attribute " + text + " has type " + (type == item.end() ? std::string("UNDEFINED") : type->dump()) +
              ", expected " + (kTypes[slot] == kOnnxFloat ? "FLOAT (1)" : "INT (2)");
      return false;
    }
    items[slot] = &item;
  }
  for (int slot = 0; slot < kSlots; ++slot) {
    if (items[slot] == nullptr) {
      error = std::string("attribute ") + kNames[slot] +
              " is missing; write the model with `sgdfuse lower --format onnx-atc`";
      return false;
    }
  }
  const Slot float_slots[2] = {kDampening, kWeightDecay};
  const Slot bits_slots[2] = {kDampeningBits, kWeightDecayBits};
  float values[2] = {0.0f, 0.0f};
  for (int k = 0; k < 2; ++k) {
    int64_t bits = 0;
    if (!ReadInt(*items[bits_slots[k]], kNames[bits_slots[k]], bits, error) ||
        !FloatFromBits(bits, kNames[bits_slots[k]], values[k], error)) {
      return false;
    }
    double encoded = 0.0;
    FloatForm form = FloatForm::kLeftOut;
    if (!ReadFloat(*items[float_slots[k]], kNames[float_slots[k]], encoded, form, error)) {
      return false;
    }
    if (!Agrees(values[k], encoded, form)) {
      error = std::string("attribute ") + kNames[float_slots[k]] + " is " + Decimal(encoded) + " but " +
              kNames[bits_slots[k]] + " holds " + Decimal(values[k]) +
              ": the model was changed after sgdfuse wrote it; write it again with `sgdfuse lower --format onnx-atc`";
      return false;
    }
  }
  int64_t nesterov = 0;
  if (!ReadInt(*items[kNesterov], kNames[kNesterov], nesterov, error)) {
    return false;
  }
  if (nesterov != 0 && nesterov != 1) {
    error = "attribute nesterov is " + std::to_string(nesterov) + ", not 0 or 1";
    return false;
  }
  attributes.dampening = values[0];
  attributes.weight_decay = values[1];
  attributes.nesterov = nesterov == 1;
  return true;
}

}  // namespace detail

// Reads the SGD attributes from json_text, the value of op_src's "attribute"; on any problem returns false
// and says what in error (attributes is then left unchanged).
inline bool ReadSgdAttributes(const std::string &json_text, SgdAttributes &attributes, std::string &error) {
  try {
    SgdAttributes read;
    if (!detail::ReadFrom(detail::Json::parse(json_text), read, error)) {
      return false;
    }
    attributes = read;
    return true;
  } catch (const std::exception &caught) {  // nlohmann's parse_error and type_error derive from std::exception
    error = std::string("the attribute JSON cannot be read: ") + caught.what();
    return false;
  }
}

}  // namespace sgdfuse_atc
"""

_PLUGIN_GE = r"""
// ---- The GE side -----------------------------------------------------------------------------------------

#include <iostream>
#include <utility>
#include <vector>

namespace domi {
namespace {
constexpr int64_t kSgdInputs = 6;   // parameters, gradient, learning_rate, accum, momentum, stat
constexpr int64_t kSgdOutputs = 3;  // parameters_out, accum_out, stat_out
// The port counts, as attributes of op_dest that AutoMappingByOpFnDynamic reads.
constexpr char kInputCountAttr[] = "sgdfuse_input_count";
constexpr char kOutputCountAttr[] = "sgdfuse_output_count";

Status Refuse(const char *node, const std::string &message) {
  std::cerr << "[sgdfuse plugin @KEY@] node " << node << ": " << message << std::endl;
  return FAILED;
}
}  // namespace

// ONNX node -> PartitionedCall with inputs x0..x5, outputs y0..y2 and GE SGD's attributes.
Status ParseParamsSgdfuseSGD(const ge::Operator &op_src, ge::Operator &op_dest) {
  ge::AscendString node_name;
  (void)op_src.GetName(node_name);
  const char *node = node_name.GetString() != nullptr ? node_name.GetString() : "?";
  ge::AscendString attributes_json;
  if (op_src.GetAttr("attribute", attributes_json) != ge::GRAPH_SUCCESS || attributes_json.GetString() == nullptr) {
    return Refuse(node, "has no ONNX attributes (ATC passes them as the JSON attribute \"attribute\"); "
                        "write the model with `sgdfuse lower --format onnx-atc`");
  }
  sgdfuse_atc::SgdAttributes attributes;
  std::string error;
  if (!sgdfuse_atc::ReadSgdAttributes(attributes_json.GetString(), attributes, error)) {
    return Refuse(node, error);
  }
  // The ports are added through the public AutoMappingByOpFnDynamic (it copies op_src's attributes, then adds
  // as many ports as the named attributes of op_dest say): ge::Operator's DynamicInputRegister and
  // DynamicOutputRegister are protected in the CANN headers up to at least 2023.
  op_dest.SetAttr(kInputCountAttr, kSgdInputs);
  op_dest.SetAttr(kOutputCountAttr, kSgdOutputs);
  const std::vector<DynamicInputOutputInfo> ports{
      DynamicInputOutputInfo(kInput, "x", 1, kInputCountAttr, static_cast<int64_t>(sizeof(kInputCountAttr) - 1)),
      DynamicInputOutputInfo(kOutput, "y", 1, kOutputCountAttr, static_cast<int64_t>(sizeof(kOutputCountAttr) - 1))};
  if (AutoMappingByOpFnDynamic(op_src, op_dest, ports) != SUCCESS) {
    return Refuse(node, "AutoMappingByOpFnDynamic could not add the 6 inputs and 3 outputs");
  }
  op_dest.SetAttr("name", node_name);
  op_dest.SetAttr("dampening", attributes.dampening);
  op_dest.SetAttr("weight_decay", attributes.weight_decay);
  op_dest.SetAttr("nesterov", attributes.nesterov);
  op_dest.SetAttr("original_type", "@KEY@");
  return SUCCESS;
}

// PartitionedCall -> subgraph: Data x6 -> SGD, plus copies of accum and stat taken after the update.
Status ParseOpToGraphSgdfuseSGD(const ge::Operator &op, ge::Graph &graph) {
  std::string name = "SGD";
  ge::AscendString name_attr;
  if (op.GetAttr("name", name_attr) == ge::GRAPH_SUCCESS && name_attr.GetString() != nullptr) {
    name = name_attr.GetString();
  }
  float dampening = 0.0f;
  float weight_decay = 0.0f;
  bool nesterov = false;
  if (op.GetAttr("dampening", dampening) != ge::GRAPH_SUCCESS ||
      op.GetAttr("weight_decay", weight_decay) != ge::GRAPH_SUCCESS ||
      op.GetAttr("nesterov", nesterov) != ge::GRAPH_SUCCESS) {
    return Refuse(name.c_str(), "the PartitionedCall lacks the SGD attributes its ParseParams function sets");
  }

  auto parameters = ge::op::Data((name + "_parameters").c_str()).set_attr_index(0);
  auto gradient = ge::op::Data((name + "_gradient").c_str()).set_attr_index(1);
  auto learning_rate = ge::op::Data((name + "_learning_rate").c_str()).set_attr_index(2);
  auto accum = ge::op::Data((name + "_accum").c_str()).set_attr_index(3);
  auto momentum = ge::op::Data((name + "_momentum").c_str()).set_attr_index(4);
  auto stat = ge::op::Data((name + "_stat").c_str()).set_attr_index(5);

  auto sgd = ge::op::SGD((name + "_sgd").c_str())
                 .set_input_parameters(parameters)
                 .set_input_gradient(gradient)
                 .set_input_learning_rate(learning_rate)
                 .set_input_accum(accum)
                 .set_input_momentum(momentum)
                 .set_input_stat(stat)
                 .set_attr_dampening(dampening)
                 .set_attr_weight_decay(weight_decay)
                 .set_attr_nesterov(nesterov);
  auto accum_out = ge::op::TensorMove((name + "_accum_out").c_str()).set_input_x(accum);
  accum_out.AddControlInput(sgd);
  auto stat_out = ge::op::TensorMove((name + "_stat_out").c_str()).set_input_x(stat);
  stat_out.AddControlInput(sgd);

  std::vector<ge::Operator> inputs{parameters, gradient, learning_rate, accum, momentum, stat};
  std::vector<std::pair<ge::Operator, std::vector<size_t>>> outputs;
  outputs.emplace_back(sgd, std::vector<size_t>{0});
  outputs.emplace_back(accum_out, std::vector<size_t>{0});
  outputs.emplace_back(stat_out, std::vector<size_t>{0});
  graph.SetInputs(inputs).SetOutputs(outputs);
  return SUCCESS;
}

REGISTER_CUSTOM_OP("PartitionedCall")
    .FrameworkType(ONNX)
    .OriginOpType("@KEY@")
    .ParseParamsByOperatorFn(ParseParamsSgdfuseSGD)
    .ParseOpToGraphFn(ParseOpToGraphSgdfuseSGD)
    .ImplyType(ImplyType::TVM);
}  // namespace domi
"""

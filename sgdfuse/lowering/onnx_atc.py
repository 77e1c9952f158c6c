"""``--format onnx-atc``: a fused ONNX model prepared for ATC's own ONNX parser, plus the op plugin source.

For users who convert ONNX with ATC (``atc --framework=5``) themselves. Facts used (from the public source of ATC's
ONNX parser; docs/lowering.md, "ONNX for ATC's parser"):

- ATC looks an op up by ``<domain>::<opset version>::<op_type>``, an empty domain read as ``ai.onnx``; a
  custom domain works when an op plugin registers exactly that key and the domain is in ``opset_import``.
- A node with an empty domain is accepted only when ``opset_import`` has one entry, so a model mixing
  ``""``-domain nodes with a custom domain fails: every standard node here gets the explicit domain
  ``ai.onnx`` (and the default-domain ``opset_import`` entry is written as ``ai.onnx``).
- The parser reads ``graph`` and ``opset_import`` only: the model-local ``FunctionProto`` of the fused op is
  dropped (ATC would ignore it; the plugin replaces it).

The key of the fused op is :data:`ATC_OP_KEY` = ``"ai.sgdfuse::1::SGD"`` (domain ``ai.sgdfuse``, version 1).

The plugin (:func:`plugin_source`, C++ text to build as a CANN ONNX framework plugin; not compiled here)
registers that key. The ONNX node has three outputs while GE's ``SGD`` declares one and writes ``accum`` and
``stat`` in place, so the key is registered as a ``PartitionedCall`` whose subgraph is
``Data x6 → SGD``, with output 0 the ``SGD`` op's ``parameters`` and outputs 1 and 2 ``TensorMove`` copies of
``accum`` and ``stat`` taken after it (control edges): the semantics of the ``.air`` lowering
(:mod:`sgdfuse.lowering.state`).
"""

from __future__ import annotations

import os
from pathlib import Path

import onnx

import sgdfuse
from sgdfuse.contract import product_line_for_soc
from sgdfuse.fused_op import DOMAIN, OP_TYPE, OP_VERSION, is_sgd_node
from sgdfuse.external_data import normalised_locations
from sgdfuse.output import OutputBatch
from sgdfuse.lowering.lower import prepare
from sgdfuse.lowering.soc import check_product_line
from sgdfuse.passes.index import build_index

__all__ = ["ATC_OP_KEY", "STANDARD_DOMAIN", "to_onnx_atc", "plugin_source", "plugin_path_for", "write_onnx_atc"]

STANDARD_DOMAIN = "ai.onnx"
ATC_OP_KEY = f"{DOMAIN}::{OP_VERSION}::{OP_TYPE}"
"""The key ATC's ONNX parser computes for the fused node: ``ai.sgdfuse::1::SGD``."""


def _explicit_domains(graph: onnx.GraphProto) -> None:
    for node in graph.node:
        if node.domain == "":
            node.domain = STANDARD_DOMAIN
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                _explicit_domains(attribute.g)
            for sub in attribute.graphs:
                _explicit_domains(sub)


def to_onnx_atc(model: str | os.PathLike | onnx.ModelProto, *, soc: str, optimise: bool = True) -> onnx.ModelProto:
    """The ATC-ready ONNX model (a new ``ModelProto``; the input is not mutated).

    The fused ``SGD`` nodes are checked against ``soc``'s product line first, as :func:`sgdfuse.lower` does;
    a model without them is optimised first unless ``optimise`` is False.

    Raises:
        ProductLineError: unknown ``soc``, or an ``SGD`` node the product line cannot run.
    """
    line = product_line_for_soc(soc)
    source, _ = prepare(model, optimise=optimise)
    check_product_line(build_index(source), [n for n in source.graph.node if is_sgd_node(n)], line)
    result = onnx.ModelProto()
    result.CopyFrom(source)
    _explicit_domains(result.graph)
    for entry in result.opset_import:
        if entry.domain == "":
            entry.domain = STANDARD_DOMAIN
    if any(is_sgd_node(n) for n in result.graph.node) and not any(e.domain == DOMAIN for e in result.opset_import):
        result.opset_import.add(domain=DOMAIN, version=OP_VERSION)
    del result.functions[:]
    # ATC maps the node by its key alone; with the functions gone, a specialised body's overload name means
    # nothing there.
    for node in result.graph.node:
        if is_sgd_node(node):
            node.ClearField("overload")
    return result


def plugin_path_for(model_path: str | os.PathLike) -> Path:
    """Where the plugin source goes beside an ONNX-ATC model: ``<stem>.sgd_onnx_plugin.cc``."""
    path = Path(model_path)
    stem = path.name[: -len(".onnx")] if path.name.endswith(".onnx") else path.name
    return path.with_name(f"{stem}.sgd_onnx_plugin.cc")


def write_onnx_atc(
    model: str | os.PathLike | onnx.ModelProto, path: str | os.PathLike, *, soc: str, optimise: bool = True
) -> tuple[Path, Path]:
    """Write the ATC-ready model to ``path`` and the plugin source beside it (both atomically); ``optimise``
    as for :func:`to_onnx_atc`.

    Returns:
        ``(model path, plugin source path)``.
    """
    # A path is loaded with its external data (checked); a ModelProto may still name data files, and none
    # that escapes the output's directory is written.
    prepared = normalised_locations(to_onnx_atc(model, soc=soc, optimise=optimise), path)
    plugin = plugin_path_for(path)
    with OutputBatch() as batch:  # the model and its plugin source together or not at all
        batch.stage(path, prepared.SerializeToString())
        batch.stage(plugin, plugin_source().encode())
        batch.commit()
    return Path(path), plugin


def plugin_source(key: str = ATC_OP_KEY) -> str:
    """C++ source of the ATC ONNX op plugin mapping ``key`` to GE ``SGD`` (see the module docstring)."""
    return _PLUGIN_TEMPLATE.replace("@KEY@", key).replace("@VERSION@", sgdfuse.__version__)


_PLUGIN_TEMPLATE = r"""// Generated by sgdfuse @VERSION@ (`sgdfuse lower --format onnx-atc`). Do not edit; regenerate.
//
// ATC ONNX parser plugin for the fused momentum-SGD op "@KEY@" (domain ai.sgdfuse, version 1):
// inputs  parameters, gradient, learning_rate, accum, momentum, stat   (the Ascend SGD contract order)
// outputs parameters_out, accum_out, stat_out
// attrs   dampening (float), weight_decay (float), nesterov (int 0/1)
//
// GE's SGD op declares one output, `parameters` (a ref of its input), and writes accum and stat in place.
// The ONNX node is therefore mapped to a PartitionedCall whose subgraph is
//     Data x6 -> SGD;  output 0 = SGD:0;  outputs 1, 2 = TensorMove(accum), TensorMove(stat) after SGD
// (control edges), i.e. copies of accum and stat taken after the in-place update.
//
// Build as the ONNX framework plugin of a CANN custom op project (framework/onnx_plugin), against
// register/register.h, graph/operator.h, graph/graph.h, the GE op prototypes (all_ops.h) and nlohmann's json.hpp.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "register/register.h"
#include "graph/operator.h"
#include "graph/graph.h"
#include "all_ops.h"
#include "json.hpp"

namespace domi {
namespace {
constexpr int kOnnxAttrFloat = 1;  // onnx.AttributeProto.FLOAT
constexpr int kOnnxAttrInt = 2;    // onnx.AttributeProto.INT
constexpr int kSgdInputs = 6;      // parameters, gradient, learning_rate, accum, momentum, stat
constexpr int kSgdOutputs = 3;     // parameters_out, accum_out, stat_out
}  // namespace

// ONNX node -> PartitionedCall: read the ONNX attributes (passed as JSON in "attribute") and keep them.
Status ParseParamsSgdfuseSGD(const ge::Operator &op_src, ge::Operator &op_dest) {
  float dampening = 0.0f;
  float weight_decay = 0.0f;
  bool nesterov = false;
  ge::AscendString attrs_string;
  if (op_src.GetAttr("attribute", attrs_string) == ge::GRAPH_SUCCESS) {
    nlohmann::json attrs = nlohmann::json::parse(attrs_string.GetString());
    for (const auto &attr : attrs["attribute"]) {
      const std::string name = attr["name"].get<std::string>();
      const int type = attr["type"].get<int>();
      if (name == "dampening" && type == kOnnxAttrFloat) {
        dampening = attr["f"].get<float>();
      } else if (name == "weight_decay" && type == kOnnxAttrFloat) {
        weight_decay = attr["f"].get<float>();
      } else if (name == "nesterov" && type == kOnnxAttrInt) {
        nesterov = attr["i"].get<int64_t>() != 0;
      }
    }
  }
  ge::AscendString node_name;
  (void)op_src.GetName(node_name);
  op_dest.SetAttr("name", node_name);
  op_dest.SetAttr("dampening", dampening);
  op_dest.SetAttr("weight_decay", weight_decay);
  op_dest.SetAttr("nesterov", nesterov);
  op_dest.DynamicInputRegister("x", kSgdInputs);
  op_dest.DynamicOutputRegister("y", kSgdOutputs);
  op_dest.SetAttr("original_type", "@KEY@");
  return SUCCESS;
}

// PartitionedCall -> subgraph: Data x6 -> SGD, plus copies of accum and stat taken after the update.
Status ParseOpToGraphSgdfuseSGD(const ge::Operator &op, ge::Graph &graph) {
  std::string name = "SGD";
  ge::AscendString name_attr;
  if (op.GetAttr("name", name_attr) == ge::GRAPH_SUCCESS) {
    name = name_attr.GetString();
  }
  float dampening = 0.0f;
  float weight_decay = 0.0f;
  bool nesterov = false;
  (void)op.GetAttr("dampening", dampening);
  (void)op.GetAttr("weight_decay", weight_decay);
  (void)op.GetAttr("nesterov", nesterov);

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

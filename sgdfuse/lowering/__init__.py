"""Lowering fused ONNX models to the Ascend Graph Engine (GE IR ``ModelDef``, the ``.air`` file ATC reads).

Entry point: :func:`lower` (also ``sgdfuse.lower``). Modules, one concept each:

- ``ge_ir.proto`` / :mod:`.ge_ir` — our wire-compatible GE IR schema and its message classes;
- :mod:`.graph_builder` — ops, ports, descriptors, edges of one ``GraphDef`` (op kinds; :class:`GraphWriter` for a graph written as it is built);
- :mod:`.registry`, :mod:`.context` — the ONNX → GE rule table and what a rule sees;
- :mod:`.rules_elementwise`, :mod:`.rules_linalg`, :mod:`.rules_tensor`, :mod:`.rules_nn`,
  :mod:`.rules_control` — the rules (layers, normalisation, pooling and losses in ``rules_nn``; ``If`` with
  small branches as a select);
- :mod:`.state` — the ``SGD`` op, its state ``Variable`` s (assigned when the ONNX input is computed) and the
  ordering of in-place writes; :mod:`.dag` — the reachability behind that ordering, linear in the graph;
  :mod:`.alias` — the one rule of which ops may return their input's memory;
- :mod:`.scopes` — one name per value across ``If`` branches, before they are inlined;
- :mod:`.soc` — product-line limits for the chosen SoC;
- :mod:`.lower` — the driver; :mod:`.ge_model` — the result (``save_air``, ``to_json``);
- :mod:`.atc_json` — ATC's model-to-JSON layout; :mod:`.executor` — the numpy reference executor (:mod:`.kernels_nn`: kernels of the
  layer, indexing and activation ops); :mod:`.verify` — the lowered graph run in place against onnxruntime (what
  ``sgdfuse lower`` checks), cutting the model into parts (:mod:`.parts`, the ops read back by :mod:`.op_scan`);
- :mod:`.onnx_atc` — ONNX prepared for ATC's own parser, and the op plugin source.
"""

from __future__ import annotations

from sgdfuse.lowering.errors import InPlaceStateError, LoweringError, UnsupportedOpError
from sgdfuse.lowering.ge_model import GEModel
from sgdfuse.lowering.lower import lower
from sgdfuse.lowering.verify import LoweringCheck, verify_lowering

__all__ = ["lower", "verify_lowering", "LoweringCheck", "GEModel", "LoweringError", "UnsupportedOpError", "InPlaceStateError"]

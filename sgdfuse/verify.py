"""Differential checks with onnxruntime: the fused update computes what the original computed, in place.

Two entry points share one design: :func:`verify_plans` (``sgdfuse optimize``, before a rewrite is applied)
runs the matched slice of the original graph beside the fused slice; :func:`check_models` (``sgdfuse
check``) runs two whole models, cut into independent groups of outputs (one per class of identical groups
from :data:`CLASS_MIN_PLANS` groups on; docs/design.md, "Verification"). Slices of up to :data:`BATCH_UPDATES` updates are batched into one model
per side, so the cost is a fixed number of onnxruntime sessions per batch, linear in the number of updates.

What is run
-----------
Every check is run in two precisions, at several sizes, over a schedule of chained steps:

The fused side always runs specialised (see "Cost"): the SGD function body inlined per node, with the same
arithmetic as the function itself.

* **Native** (the model's own dtypes): catches what only the real types show (NaN/Inf handling, the
  rounding of outputs, shapes). Its bound allows the roundings of both sides (below).
* **Lifted** (:mod:`sgdfuse.lift`: every FLOAT/FLOAT16/BFLOAT16 tensor made DOUBLE on both sides, casts to
  float types made casts to DOUBLE, the SGD function body computed in DOUBLE with its FLOAT attributes as
  stored): roundoff is gone, so what is left is the difference between the coefficients the original applies
  and those the fused op applies. A 1e-5 relative error in dampening or the learning rate stands out there
  even where the native sum of cancelling terms hides it (a Keras step fused with dampening 1 - lr).
  onnxruntime has no DOUBLE kernel for some ops (``Conv``, ``Col2Im``, ``AveragePool``,
  ``LayerNormalization``, the ``Erf`` of ``Gelu``, seen with 1.32): the nodes of those ops run in onnx's
  reference implementation, in DOUBLE, and every other node in onnxruntime, in stages
  (:func:`sgdfuse.runtime.make_session_with_reference_ops`; a slice or packed part holds only its own nodes,
  so what the reference implementation runs is those nodes of it). Only when even that cannot be built (a
  value whose type is unknown) is the lifted run skipped, *visibly*: the check's ``note`` says why, and it
  passes on the native run alone. Without the lifted run a coefficient many FLOAT ulps off passed: the whole
  steps of testdata/steps accepted a learning rate 16 ulps off (1.2e-6 relative), which the lifted run
  refuses from 7 (tests/test_verify_lifted_reference.py).
* **Sizes**: a slice with symbolic dimensions is run with every symbolic dimension = 1 and again = 3
  (:data:`SIZES`), in the same sessions; a constant of shape [2, 1] standing in for a scalar against
  parameters [N, 4] gives another shape at N = 1 and fails to broadcast at N = 3. A size at which the
  original itself cannot run is skipped (noted); a size at which only the fused side fails is a failure.
* **Schedule** (per precision and size): step 1 with a zero momentum buffer and the first-step condition
  true (as a fresh optimizer starts: it isolates the gradient term), step 2 with a zero gradient where the
  gradient is a fed input (isolates ``m·buffer``), then random steps, ``steps`` in all; then, each from the
  state reached and not chained: three steps in which every float input that is neither state, nor what the
  gradient is computed from, nor a learning-rate/momentum input is fed large (max/64), zero, and ±Inf values
  (an update whose original computes ``(x + z) - z``, ``0·z`` or ``(x·s)/s`` gives another number or NaN
  there; results that are NaN or Inf identically on both sides agree), and a first step again with the
  buffer the chain left, or random values for a buffer the chain left zero everywhere (a first step that
  ignores the old buffer must be seen to ignore it). Last, in the lifted run (natively only where there is
  none), the isolating steps (:data:`ISOLATING_KINDS`), from the original's state on both sides, which give
  each coefficient a term of its own (below, "Which step holds which coefficient").
* **A gradient that is never live** proves nothing about its term: a slice or a model that computes the
  gradient from what it is fed (``Relu(x - 10)``) may keep it at zero on every random input, and then
  ``(1 - d)·g`` is never compared, nor is which value the fused op reads as its gradient. So when an update's
  gradient was zero or not finite at every element compared on every step, one more step from the chain's
  state (:data:`WIDE`) feeds wide-range values (both signs, 1/4 to about the square root of the dtype's
  largest value) to every float input that is neither state nor a runtime coefficient, and random buffers;
  an element not finite on either side is left out there, so an overflow never fails a correct model. An
  update whose gradient is still never live fails as never compared, naming its gradient and the inputs it
  is computed from. Weight decay (``wd·p``, ``p`` random) and, in ``check``, momentum and the learning rate
  (:data:`RANDOM_STATE`) are exercised whatever the gradient; dampening multiplies the gradient.
* **In place**: the device updates ``parameters`` and ``accum`` in place. So each side carries its own
  state from step to step: the fused side by the SGD nodes' own in-place targets (``parameters_out →
  parameters``, ``accum_out → accum``, traced back through the rewrite's helper nodes), the original by the
  graph's own evidence of which output is the next value of which input: the names (``buf → buf_out``,
  ``new_buf``, ... see :func:`previous_by_name`), else the matcher's pairing. At every step the value each
  side writes into each state input is compared, besides the outputs. When the match took the wrong output
  as the buffer (``delta = 0.1·buf_out`` as ``accum_out``), the fused side writes ``delta`` into ``buf``
  and the original ``buf_out``: they differ at step 1, although the ONNX outputs are the same.
  :func:`check_models` derives the fused pairs from the fused model's SGD nodes and the original's from
  names, then from matching the original; besides the in-place run it runs the schedule in lockstep (both
  fed the original's state) so that every other output can be required to be identical.

Tolerance rule (per element, per step, per compared value)
---------------------------------------------------------
The bound is derived from the error-free terms of the operator contract (:mod:`sgdfuse.reference`), never from a sum of
terms that cancel: with ``k = 1 - d``, ``grad = g + wd·p`` and ``a`` the buffer the op reads,

    T_v = |m·a| + |k·g| + |k·wd·p|            (the buffer's terms, accum_t = m·a + k·grad)

* Coefficients: the op applies ``lr`` and ``m`` as values of the parameters' dtype and ``d``, ``wd`` as
  FLOAT attributes; the original applies its own constants. Each coefficient may differ, relative to *the
  coefficient itself*, by :data:`COEFFICIENT_ROUNDINGS` FLOAT roundings (exporters fold products of
  hyper-parameters into one rounded FLOAT constant) and, for ``lr`` and ``m`` on FLOAT16/BFLOAT16 state, one
  rounding of the parameters' dtype (their storage in it): ``ε_lr = ε_m = C·2^-24 + u_p`` (u_p the unit
  roundoff of the parameters' dtype: 2^-11 FLOAT16, 2^-8 BFLOAT16; ``C·2^-24`` alone for FLOAT,
  :func:`hyperparameter_tolerance`) and ``ε_k = ε_wd = C·2^-24``. It was ``C·u_p``, four roundings of
  BFLOAT16 (1.6 %), and a fused momentum three BFLOAT16 ulps off the original's passed; any BFLOAT16 or
  FLOAT16 value other than a 16-bit original's own is now outside (``ulp(c) > u_p·|c|``), on the compared value
  where that term dominates the others (the buffer for ``m``; for Nesterov's weights a learning rate shares the
  bound with ``ε_m·|lr·m·T_v|``, so it is told apart from about 1.5 roundings on). A graph computing in a 16-bit
  type whose exporter folded a product of hyper-parameters into one 16-bit constant (up to 4 spacings from the
  op's product, which the matcher accepts) then fails verification and stays unfused: a false failure, not a
  false pass. Note ε_k is relative to ``k = 1 - d``: a dampening near 1
  whose FLOAT attribute cannot express ``1 - d`` to that accuracy (the Keras step at lr 1e-6: ``1 - d`` off
  by 1.3e-2) fails, whatever the size of ``|g|``. So does any dampening above 1/2 whose ``1 - d`` is not
  exact in FLOAT: a graph constant 0.1 for ``1 - d`` gives the attribute 0.9 and ``1 - d = 0.10000002``,
  3.7 ulps off (the same numbers as the Keras step at lr 0.1). ``lr`` and ``m`` may be rounded to the
  parameters' dtype because the contract feeds them in it (a FLOAT-math update of BFLOAT16 state gets its
  learning rate in BFLOAT16 on the device too). So::

      B_v = ε_m·|m·a| + ε_k·|k·g| + (ε_k + ε_wd)·|k·wd·p|
      B_w = |lr|·B_v + ε_lr·|lr|·T_v                                           (plain)
      B_w = |lr|·(ε_wd·|wd·p| + |m|·B_v + ε_m·|m|·T_v) + ε_lr·|lr|·(|g| + |wd·p| + |m|·T_v)   (Nesterov)

* State carried in place: from step 2 on the two sides read states that already differ by
  ``Δp = |p_fused - p_original|`` and ``Δa`` (measured, and each checked at the step before), which the
  update propagates: ``B_v += |m|·Δa + |k·wd|·Δp``; ``B_w += (1 + |lr·k·wd|·(1+|m|))·Δp + |lr|·(|m|+m²)·Δa``.
  In :func:`check_models`' in-place run a gradient computed from the weights differs between the sides too
  (each computes it from its own weights): the original's gradient is probed beside the fused one (the value
  of the same name, which the rewrite keeps), ``g`` in every term is the larger magnitude of the two, and
  ``B_v += |k|·Δg``, ``B_w += |lr·k|·Δg`` (Nesterov ``|lr|·(1 + |m·k|)·Δg``), with ``Δg`` measured where it is
  finite. Not in lockstep, where both sides compute the gradient from the same state (a gradient computed
  otherwise fails there), and 0 wherever the gradient is fed or does not read the weights. One exception: a
  gradient that is another fused update's output itself (a chain ``g2 = 2·w1_new`` fused as ``SGD(p1, w1_new)``,
  the 2 folded into the dampening) differs between the sides by that update's rounding on every step, in
  lockstep and in :func:`verify_plans` too, and that rounding is absolute (``w1_new`` near 0 after
  cancellation): its measured difference is propagated likewise on every step, while the value itself is
  compared within its own update's bound (:attr:`_UpdateView.upstream_gradient`); so is that of a gradient
  computed from such outputs by nodes known to be the original's (``mul_3 = 2*add_1``: in :func:`verify_plans`
  they are its own nodes; ``check`` feeds such nodes one value on both sides where it can, and otherwise
  proves them equal to the original's node by node before it allows the difference); and, in ``check``, that
  of a gradient the fused node reads as the rewrite's ``Neg(y)`` of another update's output ``y`` (maximize:
  ``2*(-0.5*buf_new)`` read as ``buf_new``), whose counterpart in the original's run is ``-y``
  (:attr:`_UpdateView.negated_upstream`). The difference is allowed as a magnitude, so a coefficient error of
  the later update opposite in sign to it can hide in it (dampening 0.9 one ulp high behind the first link's
  own 3.75 roundings: tests/test_check_chained_kept_gradients.py, a strict xfail).
* Roundoff: natively, each side rounds each operation once; with at most :data:`OPERATIONS` roundings per
  side and u the unit roundoff of the parameters' dtype, ``2·OPERATIONS·u·S`` covers both, where S sums the
  magnitudes of every term either side forms (``|m·a| + (1+|d|)·(|g| + wd·|p|)`` for the buffer,
  ``|p| + |lr|·S_v`` for the weights; the op's own formula subtracts ``grad·d`` from ``m·a + grad``, and that
  rounding is real). Lifted, the same with u = 2^-53 (DOUBLE), which is negligible. Plus 4 subnormal
  spacings of the dtype.

The native bound alone is the old one (it sums cancelling magnitudes) and would let a coefficient error of
u·|g| through on a value of lr·|g|; the lifted run is what holds coefficients to a few ulps of themselves.

Values: lr and m are read from the fused run (the op's own inputs), g from the original run or the feed, d,
wd and Nesterov from the SGD node's attributes, p and a from the feeds.

Which step holds which coefficient
----------------------------------
A coefficient ``c`` off by ``δc`` moves an element by ``δc·|t|`` (``t`` its term), and the bound of that
element allows the sum of every term's allowance, ``Σ ε·|t_j|`` (plus roundoff, 2^-53-small lifted). So ``c`` is
held to a few roundings of itself only on an element where ``t`` is not small beside the other terms: a weight
decay of 1e-6 (``wd·p`` beside ``m·a`` and ``g``) off by 1 % passed, on every random element of every step. The
steps where each term stands alone (``k = 1 - d``; plain weights ``p - lr·v``, Nesterov's ``p - lr·(grad + m·v)``):

=========================  =====================================================================================
coefficient                the step and elements where its term is alone
=========================  =====================================================================================
``wd`` (with ``k``)        ``isolated``, even elements (``g = a = 0``): ``v = k·wd·p``, 0 exactly when ``wd = 0``
``wd``, first-step rule    ``isolated-first``, even elements: ``v = wd·p`` (no dampening where ``stat = 1``)
``m``                      ``isolated``, odd elements (``g = p = 0``): ``v = m·a`` (Nesterov weights ``-lr·m²·a``);
                           and the zero-gradient step where ``wd·|p|`` is small beside ``m·|a|``
``m``, first-step rule     ``isolated-first``, odd elements: ``v = m·a``, or 0 where the first step ignores the
                           old buffer (the fused node is fed it zeroed)
``d`` (as ``k``)           ``zero-buffer`` (``a = 0``, ``stat = 0``): ``v = k·(g + wd·p)``, ``k`` the factor of
                           every term; and step 1 when ``stat`` is 0 there (no first-step rule)
``lr``                     every step for ``lr·v`` (the factor of the whole step), except beside ``|p|``: a
                           step ``lr·|v|`` below the roundoff of ``p`` (lifted 16·2^-53·|p|) is held only
                           where ``p = 0``: ``isolated``, odd elements, ``p_out = -lr·m·a``
the gradient's sign        every step with a live gradient (``maximize`` flips ``g``: a difference of 2·|g|)
=========================  =====================================================================================

Bounds of these steps carry no state difference (both sides fed the original's state) and no other term's
allowance, so each coefficient is held to :data:`COEFFICIENT_ROUNDINGS` roundings of itself (``k·wd`` to the
sum of the two). What does not hold:

* The ``isolated`` steps zero what a gradient is computed from only where that makes it zero: a gradient
  fed, or computed from fed values alone (a loss scale, a clip; one-element inputs, a loss scale, are fed as on
  a random step, so ``g / scale = 0`` and a loss-scaling guard does not skip). A gradient computed from state
  (the backward pass of a whole training step in ``check``, or an update whose gradient reads another's new
  weights) is left out of them (:func:`_isolable_inputs`), and for such an update what held before holds: a
  weight decay to about ``ε·(|g| + |m·a|)/|wd·p|`` of itself on its best element, a momentum on the
  zero-gradient step where ``wd·p`` is small beside it, a learning rate wherever ``lr·|v|`` is above the
  roundoff of ``p``. ``zero-buffer`` feeds only the buffer, which is state, so it holds ``k`` whatever the
  gradient.
* A one-element state has only an even element: its momentum is held by the zero-gradient step alone, and
  its fed gradient, being one element, is not zeroed (it is fed as a loss scale would be).

Cost
----
From :data:`CLASS_MIN_PLANS` plans on, :func:`verify_plans` runs one plan per class of plans whose slices are
identical up to value names, plus a seeded sample of :data:`CLASS_SAMPLE` members; the others share that run
(``verified_as``; the argument is in :func:`verify_plans`). A training step has a few hundred classes at
most (forms x dtypes x shapes x hyper-parameters), so what is run stops growing with the number of updates;
keying costs one single-plan slice per plan (about 2 ms).
Per batch of :data:`BATCH_UPDATES` updates: four onnxruntime sessions (original and fused, native and
lifted), each run ``sizes × (steps + 4)`` times, the lifted ones 3 more (:data:`ISOLATING_KINDS`; sizes is
1 for static shapes, 2 with symbolic dimensions; one more, :data:`WIDE`, for a batch or packed model with an
update whose gradient was never live);
:func:`check_models` cuts both models into independent groups of outputs (:func:`_check_groups`), packs them
into models of about :data:`CHECK_CHUNK_NODES` nodes and runs its lockstep and in-place schedules in four
sessions per packed model; from :data:`CLASS_MIN_PLANS` groups on, per class of groups equal up to value names
(:func:`_group_key`) only the first and a sample (docs/design.md, "Verification"). Linear in the number
of updates. Session creation dominated the old two-session check, and the fused slice's (its SGD function's
``If`` branches, five per update) most of all; the fused side now runs :func:`sgdfuse.lift.specialise` d (the
SGD body inlined per node, its ``If`` s on attributes resolved, unused outputs dropped: the same arithmetic,
bit for bit), which builds about three times faster, and bit-for-bit equal values skip the bound. Measured
on the 2-core development machine (shared, load 5-9): verifying the 2000 updates of a ``bench/generate.py`` graph
(measured alternately, old and new code, same load) 49 s and 39 s before, 37 s and 33 s after; ``sgdfuse
check`` on it 54 s before, 77 s after (four whole-model sessions instead of two, ten runs per pair instead of
three); tests/test_optimize_testdata.py (37 PyTorch exports, optimize and check each) 12.4 s before, 8.9 s
after.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import heapq
import logging
import marshal
import os
import random
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from sgdfuse import collector
from sgdfuse.contract import SgdAttributes, TensorSpec
from sgdfuse.fused_op import DOMAIN, OP_TYPE, OP_VERSION, OVERLOAD_IR_VERSION, Specialisation, function_opset, read_sgd_attributes, sgd_functions_for, sgd_functions_for_overloads
from sgdfuse.lift import FLOAT_TYPES, lift_to_double, missing_kernels, specialise
from sgdfuse.passes.index import GraphIndex
from sgdfuse.passes.scan import NodeTable, node_table
from sgdfuse.passes.sgd_match import previous_by_name
from sgdfuse.runtime import ORT_KERNEL_ENV, make_session, make_session_with_reference_ops, onnx_to_numpy_dtype, run

__all__ = ["non_negative_inputs", 
    "OPERATIONS",
    "COEFFICIENT_ROUNDINGS",
    "SIZES",
    "BATCH_UPDATES",
    "CLASS_MIN_PLANS",
    "CLASS_SAMPLE",
    "UpdateCheck",
    "ModelCheck",
    "verify_plans",
    "check_models",
    "check_lowered",
    "independent_models",
    "ModelParts",
    "CHECK_CHUNK_NODES",
    "error_bound",
    "error_bound_values",
    "coefficient_bound",
    "hyperparameter_tolerance",
    "gradient_live",
    "finite_elements",
    "wide_values",
    "dead_gradient_message",
    "unit_roundoff",
    "difference",
    "previous_by_name",
]

logger = logging.getLogger(__name__)

BATCH_UPDATES = 100
"""Updates checked per onnxruntime session set (see :func:`verify_plans`)."""

OPERATIONS = 8
"""Upper bound on the roundings either side performs for one output element (the contract: grad, accum·m,
+grad, (1-stat), ·d, -, ·lr (·m, +grad for Nesterov), and the final cast)."""

COEFFICIENT_ROUNDINGS = 4
"""FLOAT roundings by which a coefficient the fused op applies may differ from the original's, relative to
the coefficient (module docstring, "Tolerance rule"; the learning rate and momentum of FLOAT16/BFLOAT16 state
one rounding of that dtype more, :func:`hyperparameter_tolerance`): the rewrite rounds each solved value
once, and exporters fold products of up to three hyper-parameters into one rounded constant.
The matcher accepts the same (4 spacings, sgdfuse.passes.precision), so what it fuses is not dropped here:
a PyTorch dampening of 0.9 (the FLOAT attribute 0.9 gives 1 - d = 0.10000002, 3.7 roundings off 0.1) is one
number; Keras's 1 - d = lr at lr 1e-3 (1.1e3 roundings off) is not."""

SIZES = (1, 3)
"""Values given to every symbolic dimension, one run each."""

EXTREME_KINDS = ("large", "zero", "inf")
"""Extra steps in which inputs that should not matter are fed extreme magnitudes."""

EXTRA_KINDS = EXTREME_KINDS + ("restart",)
"""Steps run from the state the chain reached, each alone (not chained): the extreme-value steps, and a
first step again ("restart": counters 0, first-step condition true) with the buffer the chain left, which is
where a first step that ignores the old buffer must be seen to ignore it (a buffer the chain left zero
everywhere, as a gradient zero on the fed data leaves it, is fed random values instead: :func:`_random_buffers`)."""

ISOLATING_KINDS = ("isolated", "isolated-first", "zero-buffer")
"""Steps run from the state the chain reached, each alone (not chained), after the others, that leave each
coefficient of the update a term of its own on some element, so that its allowance in the bound is relative to
that term alone (module docstring, "Which step holds which coefficient"):

* ``isolated`` (first-step condition false, ``stat = 0``), for the updates whose gradient is computed from no
  state (:func:`_isolable_inputs`; the others are fed as on a random step from the chain's state): every input
  their gradients are computed from zero (but one-element ones, a loss scale, fed as on a random step), and per
  element of their state, at even flat indices the buffer 0 (the parameters as the chain left them) and at odd
  ones the parameters 0 (the buffer random). The contract then gives ``accum_t = (1-d)·wd·p`` at even
  elements (exactly 0 when ``wd = 0``) and ``accum_t = m·a``, ``parameters_out = -lr·m·a`` (Nesterov
  ``-lr·m²·a``) at odd ones.
* ``isolated-first`` (counters 0, first-step condition true): the same feeds, so the first-step rule's
  ``wd·p`` (no dampening) and ``m·a`` (or 0, where the first step ignores the old buffer) each stand alone.
* ``zero-buffer`` (``stat = 0``): gradients as on a random step, every SGD-updated buffer 0: ``accum_t =
  (1-d)·(g + wd·p)``, where ``1 - d`` multiplies every term.

Their random values come from a generator of their own (seeded from ``seed``), so every other step is fed
what it was fed before they were added. A one-element state has only an even element: its momentum is held
by the zero-gradient step."""

RANDOM_STATE = "random-state"
"""A further lockstep step of :func:`check_models`, from the chain's state with every SGD-updated buffer fed
random values (both sides the same): a whole model computes its gradients from what it is fed, and a
gradient that is zero on that data (a dead ReLU chain) leaves a buffer that starts at zero at zero for the
whole chain, so ``momentum * accum`` would never be compared (a momentum or learning rate wired to another
constant passed ``check``; found by a fresh trial). ``verify_plans`` feeds the gradients themselves, so its
buffers leave zero after the first step."""

WIDE = "wide"
"""One more step, from the chain's state and not chained, run only when some update's gradient was zero (or not
finite) at every compared element of every step before: every float input that is neither state nor a runtime
learning rate or momentum is fed wide-range values (:func:`wide_values`: both signs, magnitudes spread from 1/4 to
about the square root of the dtype's largest value), and the buffers random values as in :data:`RANDOM_STATE`.
A whole model computes its gradients from what it is fed: ``Relu(x - 10)`` is zero for every standard-normal
``x``, so a fused model reading ``-0.5 * g`` for ``g`` passed ``check`` (a fresh trial's finding). Wide values
overflow more often (FLOAT16 above all): on this step an element that is not finite on either side is not
compared, so an overflow proves nothing either way and never fails a correct model. An update whose gradient is
still zero everywhere fails as never compared (:func:`_fail_dead_gradients`): its gradient term was not seen."""

WIDE_LOW_EXPONENT = -2
"""The smallest magnitude of :func:`wide_values` values is ``2**WIDE_LOW_EXPONENT``: well above the subnormals of every
float dtype even after a learning rate (the bound's floor is four subnormal spacings), and standard-normal steps
cover the magnitudes below 1 already."""

_UNIT_ROUNDOFF = {onnx.TensorProto.FLOAT: 2.0**-24, onnx.TensorProto.FLOAT16: 2.0**-11, onnx.TensorProto.BFLOAT16: 2.0**-8}
_SMALLEST_SUBNORMAL = {onnx.TensorProto.FLOAT: 2.0**-149, onnx.TensorProto.FLOAT16: 2.0**-24, onnx.TensorProto.BFLOAT16: 2.0**-133}
_DOUBLE_ROUNDOFF = 2.0**-53


def unit_roundoff(dtype: int) -> float:
    """Unit roundoff (half the machine epsilon) of an ONNX float dtype."""
    return _UNIT_ROUNDOFF[dtype]


# ----------------------------------------------------------------------------------------------- bounds


@dataclasses.dataclass
class _Terms:
    """The values one step of one update is bounded with (float64 magnitudes; scalars as floats)."""

    p: np.ndarray
    g: np.ndarray
    a: np.ndarray
    lr: float
    m: float
    d: float
    wd: float
    nesterov: bool
    dtype: int
    dp: np.ndarray | float = 0.0
    da: np.ndarray | float = 0.0
    dg: np.ndarray | float = 0.0
    """|Δg|: how far the gradient the fused side read is from the original's, measured (0 where the gradient is
    fed, or the original's gradient is not probed): ``check``'s in-place run, where each side computes its
    gradient from its own weights, and every step of :func:`check_lowered`, whose two implementations compute
    the gradient in their own order."""
    exact: frozenset[str] = frozenset()
    """The coefficients both sides apply bit for bit (:func:`coefficient_bound`'s ``exact``)."""


def _times(coefficient: float, magnitude):
    """``coefficient * magnitude``, 0 for a zero coefficient whatever the magnitude: a term the update does not
    form (weight decay 0 times NaN parameters) bounds nothing, and a NaN there would make the bound NaN."""
    return coefficient * magnitude if coefficient else 0.0


def _magnitudes(momentum: float, dampening: float, weight_decay: float, nesterov: bool, p, g, a, lr: float) -> tuple[np.ndarray, np.ndarray]:
    """``(S_w, S_v)``: sums of the magnitudes of every term either side forms (module docstring)."""
    m, d, wd, lr = abs(momentum), abs(dampening), abs(weight_decay), abs(lr)
    with np.errstate(invalid="ignore", over="ignore"):
        p64, g64, a64 = (np.abs(np.asarray(x, dtype=np.float64)) for x in (p, g, a))
        grad = g64 + _times(wd, p64)
        s_buffer = _times(m, a64) + (1 + d) * grad
        if nesterov:
            s_weights = p64 + _times(lr, grad + _times(m, s_buffer))
        else:
            s_weights = p64 + _times(lr, s_buffer)
    return s_weights, s_buffer


def error_bound_values(
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    p: np.ndarray,
    g: np.ndarray,
    a: np.ndarray,
    lr: float,
    dtype: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Per-element roundoff bounds ``(weights, buffer)`` on |fused - original| for one native step with
    identical inputs and identical coefficients: ``2·OPERATIONS·u·S`` plus 4 subnormal spacings (module
    docstring, "Roundoff").

    Args:
        momentum, dampening, weight_decay, nesterov: the update's hyper-parameters.
        p, g, a: the step's parameters, gradient and buffer (any float dtype; computed in float64).
        lr: the learning rate of the step.
        dtype: the parameters' ONNX dtype (FLOAT, FLOAT16 or BFLOAT16).
    """
    s_weights, s_buffer = _magnitudes(momentum, dampening, weight_decay, nesterov, p, g, a, lr)
    u = _UNIT_ROUNDOFF[dtype]
    floor = 4 * _SMALLEST_SUBNORMAL[dtype]
    return 2 * OPERATIONS * u * s_weights + floor, 2 * OPERATIONS * u * s_buffer + floor


def error_bound(plan, p: np.ndarray, g: np.ndarray, a: np.ndarray, lr: float, dtype: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`error_bound_values` with ``plan``'s hyper-parameters (a runtime momentum bounded by 1)."""
    match = plan.match
    m = abs(float(match.momentum.constant_value)) if match.momentum.is_constant else 1.0
    return error_bound_values(m, match.dampening, match.weight_decay, match.nesterov, p, g, a, lr, dtype)


def hyperparameter_tolerance(dtype: int) -> float:
    """``ε_lr = ε_m``: how far, relative to itself, the learning rate or momentum the fused op applies may be
    from the original's (module docstring, "Tolerance rule"): :data:`COEFFICIENT_ROUNDINGS` FLOAT roundings
    (the folding of hyper-parameter products into one FLOAT constant), plus, when the parameters' ``dtype`` is
    coarser than FLOAT, one rounding of it (the contract feeds ``lr`` and ``m`` in that dtype, so a FLOAT
    ``0.1`` becomes ``0.10009765625`` with ``--allow-rounding``). Not four roundings of the parameters' dtype:
    in BFLOAT16 that is 1.6 %, and a momentum three ulps off (0.91015625 for 0.8984375) passed. Every other
    BFLOAT16 or FLOAT16 value is more than one rounding from a value of the same dtype (``ulp(c) > u·|c|``).

    Args:
        dtype: the parameters' ONNX dtype (FLOAT, FLOAT16 or BFLOAT16).
    """
    folding = COEFFICIENT_ROUNDINGS * _UNIT_ROUNDOFF[onnx.TensorProto.FLOAT]
    return folding if dtype == onnx.TensorProto.FLOAT else folding + _UNIT_ROUNDOFF[dtype]


COEFFICIENTS = frozenset({"lr", "m", "d", "wd"})
"""The coefficients of an update as :func:`coefficient_bound` names them: learning rate, momentum, dampening
(through ``k = 1 - d``) and weight decay."""


def coefficient_bound(
    momentum: float, dampening: float, weight_decay: float, nesterov: bool, p, g, a, lr: float, dtype: int,
    *, exact: frozenset[str] = frozenset(),
) -> tuple[np.ndarray, np.ndarray]:
    """Per-element bounds ``(weights, buffer)`` on the difference that coefficients rounded to the op's
    storage types may cause, relative to the error-free terms (module docstring, "Tolerance rule").

    ``exact``: the coefficients (of :data:`COEFFICIENTS`) that both sides are known to apply bit for bit, which
    get no allowance (:func:`check_lowered`: the GE ``SGD`` op's attributes were compared with the fused node's,
    and its learning rate and momentum, each probed on both sides, must be equal)."""
    m, k, wd, lr = abs(momentum), abs(1.0 - dampening), abs(weight_decay), abs(lr)
    eps_f = COEFFICIENT_ROUNDINGS * _UNIT_ROUNDOFF[onnx.TensorProto.FLOAT]
    eps_p = hyperparameter_tolerance(dtype)
    eps_lr, eps_m = (0.0 if name in exact else eps_p for name in ("lr", "m"))
    eps_k, eps_wd = (0.0 if name in exact else eps_f for name in ("d", "wd"))
    with np.errstate(invalid="ignore", over="ignore"):
        p64, g64, a64 = (np.abs(np.asarray(x, dtype=np.float64)) for x in (p, g, a))
        ma, kg, kwp = _times(m, a64), _times(k, g64), _times(k * wd, p64)
        t_v = ma + kg + kwp
        b_v = _times(eps_m, ma) + _times(eps_k, kg) + _times(eps_k + eps_wd, kwp)
        if nesterov:
            b_w = _times(lr, _times(eps_wd * wd, p64) + _times(m, b_v) + _times(eps_m * m, t_v)) + _times(
                eps_lr * lr, g64 + _times(wd, p64) + _times(m, t_v))
        else:
            b_w = _times(lr, b_v) + _times(eps_lr * lr, t_v)
    return b_w, b_v


def _bounds(terms: _Terms, *, lifted: bool) -> tuple[np.ndarray, np.ndarray]:
    """The full per-element bounds ``(weights, buffer)`` of one step (module docstring)."""
    t = terms
    b_w, b_v = coefficient_bound(t.m, t.d, t.wd, t.nesterov, t.p, t.g, t.a, t.lr, t.dtype, exact=t.exact)
    s_w, s_v = _magnitudes(t.m, t.d, t.wd, t.nesterov, t.p, t.g, t.a, t.lr)
    u = _DOUBLE_ROUNDOFF if lifted else _UNIT_ROUNDOFF[t.dtype]
    floor = 4 * _SMALLEST_SUBNORMAL[t.dtype]
    m, k, wd, lr = abs(t.m), abs(1.0 - t.d), abs(t.wd), abs(t.lr)
    with np.errstate(invalid="ignore", over="ignore"):
        b_v = b_v + 2 * OPERATIONS * u * s_v + floor + _times(m, t.da) + _times(k * wd, t.dp)
        b_w = b_w + 2 * OPERATIONS * u * s_w + floor + (1 + lr * k * wd * (1 + m)) * t.dp + _times(lr * (m + m * m), t.da)
        # Each side's own gradient, computed from its own weights in place (check): what their difference feeds
        # through, k·dg into the buffer, lr·k·dg (Nesterov lr·(1 + m·k)·dg) into the weights. 0 where the gradient
        # is fed or does not read the weights: both sides then compute it from the same feeds.
        b_v = b_v + _times(k, t.dg)
        b_w = b_w + _times(lr * (1 + m * k) if t.nesterov else lr * k, t.dg)
    # A NaN left in a bound comes from a NaN term the update does form: the exact value is NaN there, both
    # sides must give NaN (difference 0), and a finite value on either side fails. (An infinite bound would
    # pass any finite difference: a wrong momentum once passed where a NaN gradient had made the parameters NaN.)
    b_w, b_v = _nan_to_num(np.asarray(b_w), nan=0.0, posinf=np.inf), _nan_to_num(np.asarray(b_v), nan=0.0, posinf=np.inf)
    if not np.isscalar(t.dg) or t.dg:
        # check_lowered: the measured |Δg| of the gradients the two sides read, propagated, added after the NaN
        # rule: a guard that keeps the old state where the gradient is NaN (a loss-scaling skip) still allows
        # the state difference the sides carry in place, and a gradient NaN on one side only (|Δg| infinite)
        # allows nothing (the gradients themselves fail their own comparison). The coefficient of the
        # gradient in the buffer is 1 - (1 - stat)·d: at most max(1, |1 - d|). The state differences are
        # propagated likewise (they are finite: a state that differed by Inf or NaN failed at the step before).
        with np.errstate(invalid="ignore", over="ignore"):
            dg = np.where(np.isfinite(t.dg), t.dg, 0.0)
            kg = max(1.0, k)
            # (a guard that keeps the old buffer carries its difference whole: coefficient 1, not m)
            carried_v = max(1.0, m) * np.where(np.isfinite(t.da), t.da, 0.0) + _times(k * wd, np.where(np.isfinite(t.dp), t.dp, 0.0))
            carried_w = (1 + lr * k * wd * (1 + m)) * np.where(np.isfinite(t.dp), t.dp, 0.0) + _times(
                lr * (m + m * m), np.where(np.isfinite(t.da), t.da, 0.0))
            # (b == 0: where the NaN rule zeroed the bound; every bound holds a positive floor elsewhere)
            b_v = b_v + _times(kg, dg) + carried_v * (b_v == 0)
            b_w = b_w + _times(lr * (1 + m * kg) if t.nesterov else lr * kg, dg) + carried_w * (b_w == 0)
    return b_w, b_v


def difference(want: np.ndarray, have: np.ndarray) -> np.ndarray:
    """Elementwise |have - want| in float64; equal values (Inf included) and NaN against NaN count 0, any other
    NaN or Inf mismatch counts Inf. Non-float arrays: 0 where equal, Inf where not."""
    want, have = np.asarray(want), np.asarray(have)
    if want.dtype.kind not in "fV" and want.dtype.name != "bfloat16":
        return np.where(want == have, 0.0, np.inf)
    want, have = want.astype(np.float64), have.astype(np.float64)
    with np.errstate(invalid="ignore"):
        same = (want == have) | (np.isnan(want) & np.isnan(have))
        return _nan_to_num(np.where(same, 0.0, np.abs(have - want)), nan=np.inf)


def _nan_to_num(x: np.ndarray, *, nan: float, posinf: float | None = None):
    """``np.nan_to_num(x, nan=nan, posinf=posinf)`` of a float64 array (the result of an arithmetic on
    float64 arrays, not shared), returned as it is when every element is finite: ``np.nan_to_num`` would
    return an equal copy (``x[()]`` for a 0-d ``x``), after three masks and several Python calls, and
    :func:`difference` and :func:`_bounds` run tens of thousands of times per verification, on values that
    are mostly finite."""
    if x.dtype == np.float64 and np.isfinite(x).all():
        return x[()] if x.ndim == 0 else x
    return np.nan_to_num(x, nan=nan, posinf=posinf)


# ------------------------------------------------------------------------------------------ tallies


@dataclasses.dataclass
class UpdateCheck:
    """The verification of one fused update.

    Attributes:
        parameters_out: the update's new-weights output (identifies the update).
        steps: chained steps run per precision and size (plus the extreme-value steps).
        passed: every compared value within its bound at every step, precision and size.
        max_abs_error: largest |fused - original| over every compared value.
        max_bound_ratio: largest |fused - original| / bound (<= 1 when passed).
        message: why it failed, or "".
        runs: what was run, e.g. ``["native size 1", "native size 3", "double size 1", "double size 3"]``.
        note: what could not be run (a precision or size skipped, and why), or "".
        verified_as: "" when this update's own slices were run; else the ``parameters_out`` of the update of
            its class (slices identical up to value names, :func:`verify_plans`) whose run this result is,
            the other fields copied from it.
    """

    parameters_out: str
    steps: int
    passed: bool
    max_abs_error: float
    max_bound_ratio: float
    message: str = ""
    runs: list[str] = dataclasses.field(default_factory=list)
    note: str = ""
    verified_as: str = ""


class _Tally:
    """Accumulates comparisons for one update (or one output in :func:`check_models`)."""

    def __init__(self, *, finite_alike: bool = False) -> None:
        self.finite_alike = finite_alike
        """Fail an element finite on one side and not on the other whatever the bound (:func:`check_lowered`:
        a bound is infinite where the update's terms are, and a guard keeping the old state there against a
        GE graph writing Inf would pass)."""
        self.passed = True
        self.max_abs = 0.0
        self.max_ratio = 0.0
        self.message = ""
        self.runs: list[str] = []
        self.notes: list[str] = []
        self.compared_finite = False
        """True once a compared original value was a finite number (all-NaN runs prove nothing)."""
        self.gradient_seen = False
        """True once the update's gradient was finite and non-zero at an element compared (finite on both
        sides) on some step: before that, its gradient term never took part in a comparison (:data:`WIDE`)."""

    def fail(self, message: str, *, structural: bool = True) -> None:
        if self.passed:
            self.passed, self.message = False, message
        if structural:  # a shape or run failure has no finite ratio
            self.max_ratio = float("inf")

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def compare(self, label: str, want, have, bound, *, finite_only: bool = False) -> None:
        """Compare ``have`` (fused) with ``want`` (original) elementwise against ``bound``. With ``finite_only``
        (a :data:`WIDE` step) an element that is not finite on either side is left out."""
        want, have = np.asarray(want), np.asarray(have)
        if want.shape != have.shape:
            self.fail(f"{label}: shape {list(have.shape)} fused vs {list(want.shape)} original")
            return
        if finite_only and want.size:
            want, have, kept = finite_elements(want, have)
            if not kept:
                return  # nothing finite on both sides: nothing compared
        if not self.compared_finite and want.size and (want.dtype.kind not in "fc" or np.isfinite(want).any()):
            self.compared_finite = True
        if want.size == 0 or (want.dtype == have.dtype and want.tobytes() == have.tobytes()):
            return  # bit for bit equal: nothing to bound
        if self.finite_alike and (want.dtype.kind == "f" or want.dtype.name == "bfloat16"):
            with np.errstate(invalid="ignore"):
                apart = np.isfinite(want.astype(np.float64)) != np.isfinite(have.astype(np.float64))
            if apart.any():
                k = int(np.argmax(apart.reshape(-1)))
                self.fail(f"{label}: element {k} is {float(have.reshape(-1)[k])!r} fused vs {float(want.reshape(-1)[k])!r} "
                          "original (finite on one side only)")
                return
        if callable(bound):
            bound = bound()
        error = difference(want, have)
        try:
            bound = np.broadcast_to(np.asarray(bound, dtype=np.float64), error.shape)
        except ValueError:  # the state read by the step already differs in shape between the two sides
            self.fail(f"{label}: the state read by this step has another shape on each side")
            return
        self.max_abs = max(self.max_abs, float(np.max(error)))
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = np.where(error == 0, 0.0, error / np.where(bound > 0, bound, 0.0))
        ratio = _nan_to_num(ratio, nan=np.inf)
        worst = int(np.argmax(ratio))
        self.max_ratio = max(self.max_ratio, float(ratio.reshape(-1)[worst]))
        if ratio.reshape(-1)[worst] > 1:
            self.fail(structural=False, message=
                f"{label}: element {worst} is {float(have.reshape(-1)[worst])!r} fused vs "
                f"{float(want.reshape(-1)[worst])!r} original; |difference| {error.reshape(-1)[worst]:.3g} exceeds "
                f"the bound {bound.reshape(-1)[worst]:.3g}"
            )


def finite_elements(want: np.ndarray, have: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
    """``want`` and ``have`` (same shape, any float dtype) with every element that is not finite in either
    replaced by 0 in both (left out of the comparison on a :data:`WIDE` step), and whether any element is
    left; arrays that are not float, or finite everywhere, as they are."""
    if want.dtype.kind != "f" and want.dtype.name != "bfloat16":
        return want, have, True
    with np.errstate(invalid="ignore"):
        keep = np.isfinite(want.astype(np.float64)) & np.isfinite(have.astype(np.float64))
    if keep.all():
        return want, have, True
    zero = np.zeros((), dtype=want.dtype)
    return np.where(keep, want, zero), np.where(keep, have, zero.astype(have.dtype)), bool(keep.any())


def gradient_live(gradient, compared: Iterable) -> bool:
    """Is some element of ``gradient`` finite and non-zero where every value of ``compared`` of the gradient's
    shape (an update's outputs and state writes, on either side) is finite? Then the gradient term took part
    in a comparison (:data:`WIDE`).

    Args:
        gradient: the gradient an update read in one step (any float dtype, BFLOAT16 included; None or a
            non-float array is never live).
        compared: the values compared for that update in that step; those of another shape are ignored.
    """
    g = _float_array(gradient)
    if g is None or g.size == 0:
        return False
    with np.errstate(invalid="ignore"):
        mask = np.isfinite(g) & (g != 0)
        if not mask.any():
            return False
        for value in compared:
            value = _float_array(value)
            if value is not None and value.shape == g.shape:
                mask &= np.isfinite(value)
    return bool(mask.any())


def _float_array(value) -> np.ndarray | None:
    """``value`` as a numpy float array (BFLOAT16 widened to DOUBLE, which numpy's ufuncs need), or None when it
    is not a float tensor."""
    if value is None:
        return None
    array = np.asarray(value)
    if array.dtype.kind == "f":
        return array
    return array.astype(np.float64) if array.dtype.name == "bfloat16" else None


# ------------------------------------------------------------------------------------------- feeds


@dataclasses.dataclass(frozen=True)
class _Input:
    """A fed value: its name, dtype, shape (symbolic dims as str) and role.

    Roles: ``parameters`` and ``accum`` (state, carried), ``gradient`` (what the update's gradient is
    computed from), ``coefficient`` (a runtime learning rate or momentum), ``other``.
    """

    name: str
    dtype: int
    shape: tuple
    role: str


def _concrete_shape(spec: _Input, size: int | None) -> tuple[int, ...]:
    return tuple(size if isinstance(d, str) else int(d) for d in spec.shape)


def _feed(spec: _Input, kind: str, step: int, size: int | None, rng: np.random.Generator, *, isolable: bool = False) -> np.ndarray:
    """The value of a non-state input for one step of the schedule (module docstring, "Schedule"). ``isolable``:
    the input is among :func:`_isolable_inputs` (zero on the ``isolated`` steps when it is a gradient input of
    more than one element)."""
    shape = _concrete_shape(spec, size)
    dtype = onnx_to_numpy_dtype(spec.dtype)
    count = int(np.prod(shape))
    if spec.role == "overflow":
        # check_lowered: a gradient a guard computed in the graph reads (found_inf = any(!isfinite(g)), no loss
        # scale to make it NaN on the zero-gradient step): +Inf on the "inf" step, so the skip is taken there;
        # a gradient on every other step.
        if kind == "inf":
            return np.full(shape, np.inf, dtype=dtype)
        spec = dataclasses.replace(spec, role="gradient")
    if spec.dtype in FLOAT_TYPES or spec.dtype == onnx.TensorProto.DOUBLE:
        if kind == WIDE and spec.role in ("gradient", "other", "non-negative"):
            values = _extreme(kind, shape, dtype, rng)
            return np.abs(values) if spec.role == "non-negative" else values
        if spec.role in ("gradient", "momentum") and kind == "zero-gradient":
            # A runtime momentum 0 (check_lowered's role "momentum"): the op keeps the buffer, and the rewrite's
            # If recomputes it.
            return np.zeros(shape, dtype=dtype)
        if isolable and spec.role == "gradient" and kind in ("isolated", "isolated-first") and count > 1:
            # (A one-element input the gradient is computed from, a loss scale, is fed as on a random step: g/0
            # would make a loss-scaling guard skip, and nothing would be compared.)
            return np.zeros(shape, dtype=dtype)
        if spec.role == "other" and kind in EXTREME_KINDS:
            return _extreme(kind, shape, dtype, rng)
        if spec.role == "non-negative":
            # Read where only non-negative values are defined (a BatchNormalization variance, a Sqrt).
            return np.abs(rng.standard_normal(shape)).astype(np.float32).astype(dtype)
        if count == 1 and spec.role != "gradient":
            # A runtime scalar feeding the update (a learning rate fed as an input): a learning-rate-like value.
            return rng.uniform(0.01, 0.1, size=shape).astype(np.float32).astype(dtype)
        return rng.standard_normal(shape).astype(np.float32).astype(dtype)
    if np.issubdtype(dtype, np.integer):
        # Integer scalars are read as step counters (0 on the first step, then 1, 2, ...); integer tensors
        # (class labels, say) are zeros, valid for any number of classes.
        return np.full(shape, step if count == 1 else 0, dtype=dtype)
    if dtype == np.bool_:
        return np.full(shape, step == 0, dtype=bool)
    raise ValueError(f"cannot verify: no test data for {spec.name} of dtype {dtype}")


def _extreme(kind: str, shape: tuple[int, ...], dtype: np.dtype, rng: np.random.Generator) -> np.ndarray:
    """The values of an input on an extreme-value step (:data:`EXTREME_KINDS`, :data:`WIDE`), in ``dtype``."""
    if kind == WIDE:
        return wide_values(shape, dtype, rng)
    signs = np.where(rng.standard_normal(shape) < 0, -1.0, 1.0)
    if kind == "zero":
        return np.zeros(shape, dtype=dtype)
    if kind == "inf":
        return (signs * np.inf).astype(dtype)
    big = float(np.finfo(np.float32 if dtype == np.float64 else dtype).max) / 64
    return (signs * big).astype(dtype)


def wide_values(shape: tuple[int, ...], dtype: np.dtype, rng: np.random.Generator) -> np.ndarray:
    """Values of :data:`WIDE` steps: ``n`` elements whose magnitudes ``2**e`` are stratified over ``[low, top]``
    (one exponent drawn uniformly in each of ``n`` equal parts, so every part of the range is hit once), with
    alternating signs from the largest down (the two largest have opposite signs), in a random order.
    ``low`` is :data:`WIDE_LOW_EXPONENT`; ``top = log2(max)/2 - 2`` of ``dtype`` (FLOAT and BFLOAT16 about 2**62,
    FLOAT16 2**6): a product of two such values stays finite, so a gradient computed as a product of inputs (a
    ``MatMul`` of activations) is not infinite at once, while ``Relu(x - c)`` is non-zero for any moderate
    ``c`` (on a tensor of a few elements). DOUBLE is given FLOAT's range: lifted runs feed FLOAT values."""
    count = int(np.prod(shape))
    largest = float(np.finfo(np.float32 if dtype == np.float64 else dtype).max)
    top = np.log2(largest) / 2 - 2
    exponents = WIDE_LOW_EXPONENT + (top - WIDE_LOW_EXPONENT) * (np.arange(count) + rng.uniform(size=count)) / max(count, 1)
    signs = np.where((count - 1 - np.arange(count)) % 2 == 0, 1.0, -1.0)
    return rng.permutation(signs * np.exp2(exponents)).reshape(shape).astype(dtype)


def _state_initial(spec: _Input, size: int | None, rng: np.random.Generator) -> np.ndarray:
    shape = _concrete_shape(spec, size)
    dtype = onnx_to_numpy_dtype(spec.dtype)
    if spec.dtype not in FLOAT_TYPES and spec.dtype != onnx.TensorProto.DOUBLE:
        return _feed(spec, "first", 0, size, rng)
    if spec.role == "accum":
        return np.zeros(shape, dtype=dtype)  # a fresh optimizer's buffer
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


def _random_state(spec: _Input, size: int | None, rng: np.random.Generator) -> np.ndarray:
    """A momentum buffer's value after some steps (:data:`RANDOM_STATE`): standard-normal, in its dtype."""
    return rng.standard_normal(_concrete_shape(spec, size)).astype(np.float32).astype(onnx_to_numpy_dtype(spec.dtype))


def _counter(kind: str, step: int, chained: int) -> int:
    """The step counter fed with a step: its index in the chain; 0 for a restart and an ``isolated-first``
    step; after the chain for the other extra steps."""
    return 0 if kind in ("restart", "isolated-first") else min(step, chained)


def _isolating_pair(pair: "_Pair", pairs: Sequence["_Pair"]) -> bool:
    """Whether ``pair`` runs the :data:`ISOLATING_KINDS` steps: the lifted (DOUBLE) pair, or the native one when
    there is no lifted pair. Lifted, the roundoff is gone and each isolated term is held to its coefficients'
    allowance alone; natively the same term is held to that plus its own roundoff, which adds nothing the
    lifted run does not see, at the cost of the steps."""
    return pair.lifted or not any(other.lifted for other in pairs)


def _isolable_inputs(views: Sequence["_UpdateView"], sources_of: Callable[["_UpdateView"], Iterable[str]], state: set[str]) -> frozenset[str]:
    """What the ``isolated`` steps zero (gradient inputs) and mask (parameters and buffers): for every update
    whose gradient is computed from no state (fed, or from fed values alone: a loss scale, a clip; ``sources_of``
    gives the fed inputs it is computed from), those inputs and its parameters and buffer. A gradient computed
    from state (a backward pass through the weights: every gradient of a whole training step) is not made zero
    by zero inputs, so its terms would not stand alone; and a zero image through weights half zero is a
    degenerate feed (a BatchNormalization of a constant) on which two implementations of one network round
    apart by far more than on data (``lower``'s check of a ResNet step: a gradient of 2e-13 against 5e5)."""
    names: set[str] = set()
    for view in views:
        sources = set(sources_of(view))
        if sources.isdisjoint(state):
            names.update(sources)
            names.update((view.parameters, view.accum))
    return frozenset(names)


def _isolating_kinds(isolating: bool, inputs: Iterable[_Input], isolable: frozenset[str]) -> list[str]:
    """The :data:`ISOLATING_KINDS` a run takes: none unless ``isolating`` (:func:`_isolating_pair`); the
    ``isolated`` ones only when some input of the run is ``isolable``."""
    if not isolating:
        return []
    if any(spec.name in isolable for spec in inputs):
        return list(ISOLATING_KINDS)
    return [kind for kind in ISOLATING_KINDS if kind not in ("isolated", "isolated-first")]


def _isolating_rng(seed: int) -> np.random.Generator:
    """The random generator of the :data:`ISOLATING_KINDS` steps of one run (apart from the run's own)."""
    return np.random.default_rng((seed, 1))


def _isolating_state(kind: str, specs: Iterable[_Input], original_feeds: dict, fused_feeds: dict, size: int | None,
                     rng: np.random.Generator, convert, isolable: frozenset[str]) -> None:
    """Feed the SGD-updated state of an :data:`ISOLATING_KINDS` step, the same on both sides (the original's
    parameters: in place, the state each side carried already differs, and that difference, allowed for whole,
    would hide a small term): every buffer (role ``accum``) 0 on a ``zero-buffer`` step; else, for the
    ``isolable`` state (:func:`_isolable_inputs`; the rest as the chain left it), the buffers random with their
    even flat indices 0, and the parameters (role ``parameters``) with their odd flat indices 0."""
    for spec in specs:
        if spec.name not in original_feeds or (kind != "zero-buffer" and spec.name not in isolable):
            continue
        if spec.role == "accum":
            if kind == "zero-buffer":
                value = convert(np.zeros(_concrete_shape(spec, size), dtype=onnx_to_numpy_dtype(spec.dtype)))
            else:
                value = _random_state(spec, size, rng)
                value.reshape(-1)[0::2] = 0
                value = convert(value)
        elif spec.role == "parameters":
            value = original_feeds[spec.name]
            if kind != "zero-buffer":
                value = np.array(value, copy=True)
                value.reshape(-1)[1::2] = 0
        else:
            continue
        original_feeds[spec.name] = fused_feeds[spec.name] = value


def _schedule(steps: int) -> list[str]:
    kinds = ["first", "zero-gradient"] + ["random"] * max(0, steps - 2)
    return kinds[:steps]


def _lifted_array(array: np.ndarray) -> np.ndarray:
    array = np.asarray(array)
    if array.dtype.kind == "f" or array.dtype.name == "bfloat16":
        return array.astype(np.float64)
    return array


# ------------------------------------------------------------------------------------------ sessions


class _Pair:
    """The original and fused models of one precision, as sessions for :func:`sgdfuse.runtime.run`.

    Lifted (DOUBLE), each side is made by :func:`sgdfuse.runtime.make_session_with_reference_ops`: the nodes
    of the op types onnxruntime has no DOUBLE kernel for (``Conv``, ``Col2Im``, ``LayerNormalization``, the
    ``Erf`` of ``Gelu``, ...) run in onnx's reference implementation and every other node in onnxruntime, so that
    a slice or a part holding one is still compared in DOUBLE. ``referenced`` lists those op types (both sides).

    Raises:
        onnxruntime's error or ValueError (:func:`sgdfuse.runtime.make_session_with_reference_ops`): a side that
            cannot run even so.
    """

    def __init__(self, original: onnx.ModelProto, fused: onnx.ModelProto, lifted: bool, known: Iterable[str] = ()) -> None:
        self.lifted = lifted
        self.label = "double" if lifted else "native"
        self.referenced: list[str] = []
        if not lifted:
            self.original, self.fused = make_session(original), make_session(fused)
            return
        known = tuple(known)
        self.original, found = make_session_with_reference_ops(lift_to_double(original), known=known)
        # The fused side holds the original's other nodes: what the original lacked, it lacks.
        self.fused, more = make_session_with_reference_ops(lift_to_double(fused), known=(*known, *found))
        self.referenced = sorted({*found, *more})

    @classmethod
    def of_sessions(cls, original, fused, lifted: bool) -> "_Pair":
        """A pair of sessions made elsewhere (:func:`check_lowered`: the fused side is not onnxruntime)."""
        pair = cls.__new__(cls)
        pair.lifted, pair.label, pair.original, pair.fused = lifted, "double" if lifted else "native", original, fused
        pair.referenced = []
        return pair


def _make_pairs(original: onnx.ModelProto, fused: onnx.ModelProto, known: Iterable[str] = ()) -> tuple[list[_Pair], str, list[str]]:
    """The native pair, and the lifted pair (:class:`_Pair`: the nodes onnxruntime has no DOUBLE kernel for run
    in onnx's reference implementation); the note says why there is no lifted pair when even that cannot run,
    and then the op types without a DOUBLE kernel are listed when onnxruntime names them.

    ``known``: op types found without a DOUBLE kernel in another part of the same model (see
    :func:`sgdfuse.runtime.make_session_with_reference_ops`); the lifted pair's own are its ``referenced``.

    The fused side runs :func:`sgdfuse.lift.specialise` d: the SGD function body inlined per node with its
    attributes, the ``If`` s on them resolved (same arithmetic, bit for bit; sessions build ~3x faster).
    With the native kernel asked for (``SGDFUSE_ORT_KERNEL=1``, :mod:`sgdfuse.runtime`) the native pair keeps
    the SGD nodes, so the kernel runs them; the lifted (DOUBLE) pair runs the inlined bodies as without it."""
    inlined = fused
    try:
        inlined = specialise(fused)
    except Exception as error:  # onnx's inliner refusing a model: run the functions as they are (slower)
        logger.info("could not inline the fused model's functions (%s); running it as it is", error)
    kernel = os.environ.get(ORT_KERNEL_ENV) == "1"
    pairs = [_Pair(original, fused if kernel else inlined, lifted=False)]
    try:
        lifted = _Pair(original, inlined, lifted=True, known=known)
    except Exception as error:  # onnxruntime's own exception types (a refusal naming no kernel), unknown types
        ops = missing_kernels(error)
        reason = f"onnxruntime has no DOUBLE kernel for {', '.join(ops)}" if ops else str(error).strip().splitlines()[0]
        return pairs, f"the lifted (DOUBLE) comparison could not run ({reason}); checked in the native dtypes only", ops
    if lifted.referenced:
        logger.info("lifted run: %s computed by onnx's reference implementation (no DOUBLE kernel in onnxruntime)",
                    ", ".join(lifted.referenced))
    pairs.append(lifted)
    return pairs, "", []


def _sizes(inputs: Iterable[_Input]) -> tuple[int | None, ...]:
    """:data:`SIZES` when some input has a symbolic dimension, else ``(None,)`` (one run)."""
    return SIZES if any(isinstance(d, str) for spec in inputs for d in spec.shape) else (None,)


def _run_label(precision: str, size: int | None) -> str:
    return precision if size is None else f"{precision}, size {size}"


# --------------------------------------------------------------------------------------- graph helpers


def _subgraph_reads(graph: onnx.GraphProto) -> set[str]:
    defined = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    reads: set[str] = set()
    for node in graph.node:
        defined.update(o for o in node.output if o)
    for node in graph.node:
        reads.update(name for name in _node_reads(node) if name not in defined)
    return reads


_NO_SUBGRAPHS = frozenset({("", op) for op in ("Add", "Sub", "Mul", "Div", "Neg", "Cast", "CastLike", "Identity", "Where",
                                                 "Constant", "ConstantOfShape", "Reshape", "Gather", "Equal", "Relu", "MatMul",
                                                 "Transpose", "Sqrt", "Abs", "Not", "Shape", "Expand")})
"""Standard ops that never hold a subgraph: their reads are their inputs (no walk over their attributes)."""


def _node_reads(node: onnx.NodeProto) -> list[str]:
    names = [name for name in node.input if name]
    if (node.domain, node.op_type) in _NO_SUBGRAPHS:
        return names
    for attribute in node.attribute:
        subs = [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else list(attribute.graphs)
        for sub in subs:
            names.extend(sorted(_subgraph_reads(sub)))
    return names


def _trace_to_state(value: str, producers: Mapping[str, onnx.NodeProto]) -> str:
    """The state value an SGD input is written back to: followed back through the rewrite's helpers
    (``Where(first_step, 0, accum)``, casts, copies) to the value they pass on."""
    seen: set[str] = set()
    while value in producers and value not in seen:
        seen.add(value)
        node = producers[value]
        if node.op_type == "Where" and len(node.input) == 3:
            value = node.input[2]
        elif node.op_type in ("Cast", "CastLike", "Identity") and node.input:
            value = node.input[0]
        else:
            break
    return value


def _forward_buffer(value: str, readers: Sequence[onnx.NodeProto]) -> str:
    """The SGD node's buffer output as the graph sees it: through the rewrite's ``If(momentum == 0)``
    that recomputes it for a zero runtime momentum, when there is one."""
    for node in readers:
        if node.op_type == "If" and value in _node_reads(node) and value not in node.input:
            return node.output[0]
    return value


def _through_guard(
    value: str, state: str, readers: Sequence[onnx.NodeProto], producer: Callable[[str], onnx.NodeProto | None] = lambda name: None
) -> str:
    """What is written into ``state``: ``value``, or the guard ``Where(condition, state, value)`` (either
    branch order; ``state`` possibly through ``Identity`` copies, ``p.detach()``, found by ``producer``) that
    selects it, as a guarded update's graph keeps it after the fused node (the device writes the selection
    back; sgdfuse.lowering.state)."""
    for node in readers:
        if node.op_type == "Where" and len(node.input) == 3 and value in node.input[1:] and value != state:
            if state in {_identity_source(branch, producer) for branch in node.input[1:]}:
                return node.output[0]
    return value


def _identity_source(value: str, producer: Callable[[str], onnx.NodeProto | None]) -> str:
    """The value ``value`` copies through ``Identity`` nodes (itself when it is none's output)."""
    seen = {value}
    node = producer(value)
    while node is not None and node.op_type == "Identity" and node.input and node.input[0] not in seen:
        value = node.input[0]
        seen.add(value)
        node = producer(value)
    return value


def _topological(nodes: Sequence[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """``nodes`` in an order where every producer comes before its readers, otherwise as given."""
    producer = {o: k for k, node in enumerate(nodes) for o in node.output if o}
    waiting = [0] * len(nodes)
    dependants: dict[int, list[int]] = {}
    for k, node in enumerate(nodes):
        for name in set(_node_reads(node)):
            source = producer.get(name)
            if source is not None and source != k:
                waiting[k] += 1
                dependants.setdefault(source, []).append(k)
    ready = [k for k in range(len(nodes)) if waiting[k] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        k = heapq.heappop(ready)
        order.append(nodes[k])
        for d in dependants.get(k, ()):
            waiting[d] -= 1
            if waiting[d] == 0:
                heapq.heappush(ready, d)
    if len(order) != len(nodes):
        raise ValueError("the slice has a cycle")
    return order


class _Probes:
    """``Identity`` copies of values as slice outputs (a graph input or initializer cannot always be one),
    one per value however many SGD nodes read it (a shared learning rate), or with ``shared`` False one per call."""

    def __init__(self, taken: set[str], base: Iterable[str] | Mapping[str, object] = (), *, shared: bool = True) -> None:
        self.taken = taken
        self.base = base
        self.shared = shared
        self.nodes: list[onnx.NodeProto] = []
        self.copies: list[tuple[str, str]] = []
        """Per node of ``nodes``: ``(the value it copies, its output)``."""
        self._made: dict[str, str] = {}
        self._next: dict[str, int] = {}

    def __call__(self, value: str, tag: str) -> str:
        if self.shared and value in self._made:
            return self._made[value]
        base = name = f"sgdfuse_probe/{tag}/{value}"
        counter = self._next.get(base, 1)  # unshared probes of one value: no rescan of the names taken
        while name in self.taken or name in self.base:
            name = f"{base}_{counter}"
            counter += 1
        self._next[base] = counter
        self.taken.add(name)
        self.nodes.append(helper.make_node("Identity", [value], [name]))
        self.copies.append((value, name))
        self._made[value] = name
        return name


# ------------------------------------------------------------------------------------------- slices


@dataclasses.dataclass
class _UpdateView:
    """How one fused update is seen in a run: the values to compare and the values its bound reads."""

    key: str
    outputs: dict[str, str]
    """output name → role ("w" or "v"), compared between the two sides."""
    original_state: dict[str, str]
    """state input → the original's next value of it."""
    fused_state: dict[str, str]
    """state input → the value the fused op writes into it."""
    roles: dict[str, str]
    """state input → role ("w" or "v")."""
    parameters: str
    accum: str
    gradient: str
    """where the gradient is read: an original output or feed (verify) or a fused probe (check)."""
    gradient_side: str
    learning_rate: str
    momentum: str
    dampening: float
    weight_decay: float
    nesterov: bool
    dtype: int
    original_gradient: str = ""
    """``check``: the value the fused SGD node reads as its gradient, as an output of the original, when the
    original computes a value of that name ("" otherwise, and in ``verify_plans``, whose gradient is one
    value for both sides; :func:`check_lowered`: the gradient probed on both sides under one name). In place, each side computes its gradient from its own weights, and the bound adds
    what their difference feeds through (:func:`_bounds`)."""
    gradient_operand: str = ""
    """``check``: the value the fused SGD node reads as its gradient (what :attr:`gradient` probes)."""
    upstream_gradient: str = ""
    """When the gradient is another fused update's output itself (a chain ``g2 = 2*w1_new`` whose ``2*(1-d)``
    folded into the next node's dampening: ``SGD(p1, w1_new, ...)``), that output's name, the same in both
    runs and compared there within that update's bound: the two sides' values of it differ by that update's
    rounding, which is absolute (``ulp(|p| + lr·|v|)``, large beside a ``w1_new`` near 0), so on every step,
    lockstep too, the bound propagates their measured difference (:func:`_view_terms`). Also when the gradient
    is computed from such outputs by nodes known to be the same on both sides (``mul_3 = 2*add_1``): the
    gradient's name (:func:`_mark_computed_upstream_gradients` in :func:`verify_plans`, where they are the
    original's own nodes; :func:`_mark_proven_upstream_gradients` in ``check``, where they are proven equal
    to the original's node by node). "" otherwise."""
    negated_upstream: str = ""
    """``check``: when the fused SGD node's gradient is a ``Neg`` of another update's compared output ``y``
    (the rewrite's negation of a gradient read with maximize: ``g2 = 2*(-0.5*buf1_new)`` read as ``buf1_new``,
    maximize, ``lr·2 = 1``), ``y``'s name. The original has no value of the operand's name, so its counterpart
    is ``-y`` of the original's run (negation is exact), and the bound propagates the measured difference of the
    two sides' ``y`` as for :attr:`upstream_gradient` (:func:`_view_terms`). Sound whatever the original
    computes its gradient with: that difference is what the fused node's own ``Neg`` makes of the difference of
    ``y``, compared within its own update's bound, and how far the original's gradient is from ``-y`` is left to
    the bound (a coefficient off there fails). "" otherwise."""
    exact_coefficients: frozenset[str] = frozenset()
    """:func:`check_lowered`: the coefficients (of :data:`COEFFICIENTS`) that both implementations are held to
    apply bit for bit, so that the bound gives them no allowance."""


@dataclasses.dataclass
class _Slices:
    original: onnx.ModelProto
    fused: onnx.ModelProto
    inputs: list[_Input]
    original_outputs: list[str]
    fused_outputs: list[str]
    views: list[_UpdateView]


def _build_slices(
    model: onnx.ModelProto,
    index: GraphIndex,
    plans: Sequence,
    shared: Mapping[str, onnx.TensorProto],
    evidence: Mapping[str, str] | None = None,
    *,
    models: bool = True,
) -> _Slices:
    """The original and fused slices of ``plans`` (module docstring), with the views to compare them.
    ``evidence``: :func:`_name_evidence` of the graph, computed here when not given (it reads every output).
    With ``models`` False, ``original`` and ``fused`` are the :class:`_Parts` the models would be built from."""
    graph_nodes = index.graph.node
    cone = set().union(*(plan.match.nodes for plan in plans))
    if evidence is None:
        evidence = _name_evidence(index.graph_outputs, index.state_names)

    views: list[_UpdateView] = []
    wanted_original: list[str] = []
    # Readers in the original graph of the values the fused nodes replace (a guard's Where stays and reads them).
    replaced_values = {o for plan in plans for o in (plan.match.parameters_out, plan.match.accum_out)}
    graph_readers: dict[str, list[onnx.NodeProto]] = {}
    for name in replaced_values:
        graph_readers[name] = [graph_nodes[k] for k in index.consumers.get(name, ())]

    def producer_of(name: str) -> onnx.NodeProto | None:
        k = index.producer.get(name)
        return None if k is None else graph_nodes[k]
    for plan in plans:
        match = plan.match
        sgd = plan.sgd_node
        helpers = {o: node for node in plan.nodes for o in node.output if o}
        targets = {_trace_to_state(sgd.input[0], helpers): "w", _trace_to_state(sgd.input[3], helpers): "v"}
        fused_state = {}
        for target, role in targets.items():
            written = sgd.output[0] if role == "w" else _forward_buffer(sgd.output[1], plan.nodes)
            fused_state[target] = _through_guard(written, target, graph_readers.get(written, ()), producer_of)
        matched = {match.parameters: match.parameters_out, match.accum: match.accum_out}
        # A guarded update's next state is its guard's selection on both sides.
        matched.update({state: output for state, output in fused_state.items() if output in index.producer and output not in replaced_values})
        original_state = {s: evidence.get(s) or matched.get(s) for s in targets}
        original_state = {s: o for s, o in original_state.items() if o}
        outputs = {match.parameters_out: "w", match.accum_out: "v"}
        for state, output in original_state.items():
            outputs.setdefault(output, targets[state])
        attributes = read_sgd_attributes(sgd)
        views.append(
            _UpdateView(
                key=match.parameters_out, outputs=outputs, original_state=original_state, fused_state=fused_state,
                roles=targets, parameters=match.parameters, accum=match.accum, gradient=match.gradient,
                gradient_side="original", learning_rate=plan.learning_rate_input, momentum=plan.momentum_input,
                dampening=attributes.dampening, weight_decay=attributes.weight_decay, nesterov=attributes.nesterov,
                dtype=match.dtype,
            )
        )
        wanted_original.extend(outputs)
    _mark_upstream_gradients(views, [view.gradient for view in views])

    # The original's next values named by evidence may lie outside the matched cone: add what computes them.
    cone_produced = {o for i in cone for o in graph_nodes[i].output if o}
    extra = _closure(index, [name for name in wanted_original if name not in cone_produced], cone_produced)
    extra |= _shape_producers(index, cone | extra)
    original_indices = sorted(cone | extra)
    original_nodes = [graph_nodes[i] for i in original_indices]
    produced = {o for node in original_nodes for o in node.output if o}
    gradients = [view.gradient for view in views if view.gradient in produced]
    original_outputs = list(dict.fromkeys(wanted_original + gradients))
    computed_upstream = _mark_computed_upstream_gradients(views, original_nodes, replaced_values)
    original_parts = _Parts(original_nodes, [], original_outputs, list(model.opset_import), None)
    original, original_inputs = _slice_model(index, original_parts) if models else _parts_inputs(index, original_parts)

    replaced = {o for plan in plans for o in (plan.match.parameters_out, plan.match.accum_out)}
    kept = [graph_nodes[i] for i in original_indices if not replaced.intersection(graph_nodes[i].output)]
    fused_nodes = kept + [node for plan in plans for node in plan.nodes]
    taken = {o for node in fused_nodes for o in node.output}
    probe = _Probes(taken, index.state_names)  # a cached set: no pass over the graph per slice
    for view in views:
        view.learning_rate = probe(view.learning_rate, "learning_rate")
        view.momentum = probe(view.momentum, "momentum")
    fused_outputs = list(dict.fromkeys(
        [o for view in views for o in list(view.outputs) + list(view.fused_state.values())]
        + [o for view in views for o in (view.learning_rate, view.momentum)]
        + [o for o in computed_upstream if o in taken]  # the fused side's value of it, computed by the same kept nodes
    ))
    opsets = list(model.opset_import)
    if not any(o.domain == DOMAIN for o in opsets):
        opsets.append(helper.make_opsetid(DOMAIN, OP_VERSION))
    read = {name for node in fused_nodes for name in _node_reads(node)}
    fused_initializers = [tensor for name, tensor in shared.items() if name in read]
    fused_parts = _Parts(_topological(fused_nodes + probe.nodes), fused_initializers, fused_outputs, opsets, function_opset(model))
    fused, fused_inputs = _slice_model(index, fused_parts) if models else _parts_inputs(index, fused_parts)

    names = list(dict.fromkeys(original_inputs + fused_inputs))
    inputs = _classify_inputs(index, names, views, plans, original_nodes)
    return _Slices(original, fused, inputs, original_outputs, fused_outputs, views)




def _mark_upstream_gradients(views: Sequence[_UpdateView], gradients: Sequence[str], compared: set[str] | None = None) -> None:
    """Set :attr:`_UpdateView.upstream_gradient` of each view whose gradient, ``gradients[k]`` (the value its SGD
    node reads), is another view's output, compared between the two sides (with ``compared``, only those
    of its names: ``check``'s graph outputs)."""
    owner = {name: k for k, view in enumerate(views) for name in view.outputs if compared is None or name in compared}
    for k, (view, gradient) in enumerate(zip(views, gradients, strict=True)):
        if owner.get(gradient, k) != k:
            view.upstream_gradient = gradient


def _mark_computed_upstream_gradients(views: Sequence[_UpdateView], original_nodes: Sequence[onnx.NodeProto],
                                      replaced: set[str]) -> list[str]:
    """:func:`verify_plans`: set :attr:`_UpdateView.upstream_gradient` of each view whose gradient is computed in
    the slice (``original_nodes``) from another view's output (``replaced``: the values the fused nodes
    replace), a chain ``g2 = 2*w1_new`` whose SGD node reads ``mul_3 = 2*add_1``; returns those gradients.

    Why the measured difference of such a gradient is a sound allowance here: the fused slice is the original
    slice's own nodes (the same ``NodeProto`` s) except those that write a replaced value, which the plans'
    nodes write instead, and a plan's nodes write only replaced values and names of their own. So on the fused
    side the gradient is computed by the very nodes of the original from the same feeds and from the replaced
    values, each of them compared within its own update's bound on every step; the two sides' values of the
    gradient can differ only by what those nodes make of the replaced values' differences, and nothing of the
    rewrite sits in between to hide in that difference. (In :func:`check_models` the fused model is any model, and
    its nodes between an update's output and a gradient are not known to be the original's: there they read a
    fed value on both sides instead, :func:`_feed_update_readers`.)"""
    producer = {o: node for node in original_nodes for o in node.output if o}
    owner = {name: k for k, view in enumerate(views) for name in view.outputs if name in replaced}
    marked: list[str] = []
    for k, view in enumerate(views):
        if view.upstream_gradient or view.gradient not in producer:
            continue
        stack, seen, upstream = [view.gradient], {view.gradient}, False
        while stack and not upstream:
            value = stack.pop()
            if owner.get(value, k) != k:
                upstream = True
            elif value in owner or value not in producer:
                continue  # its own update's output (never: a cycle), or fed
            else:
                for name in _node_reads(producer[value]):
                    if name not in seen:
                        seen.add(name)
                        stack.append(name)
        if upstream:
            view.upstream_gradient = view.gradient
            marked.append(view.gradient)
    return marked


def _overload_problem(node: onnx.NodeProto) -> str:
    """Why an SGD node's specialised body (its ``overload``) does not fit its attributes, or "" when it does
    (or it calls the general body): the body assumes them, the lowered GE op reads them."""
    if not node.overload:
        return ""
    try:
        Specialisation.from_overload(node.overload).check(read_sgd_attributes(node), subject=node.name or "SGD node")
    except ValueError as error:
        return str(error)
    return ""


class _ConstantInputs:
    """The constant value of a main-graph value where the graph fixes it: an initializer that is no graph input,
    a ``Constant``'s ``value``, every element of a ``ConstantOfShape`` (its ``value``, FLOAT +0 without one),
    through ``Identity``, ``Cast``, ``CastLike``, ``Expand`` and ``Reshape`` of such (which keep the elements'
    values, +0 included); None elsewhere. Read when asked, one look-up table built once."""

    _KEEP = frozenset({"Identity", "Cast", "CastLike", "Expand", "Reshape"})

    def __init__(self, graph: onnx.GraphProto, producers: Mapping[str, onnx.NodeProto] | None = None) -> None:
        """``producers``: value name → the node of ``graph`` that outputs it (the last one, as a dict built over
        ``graph.node`` has it), when the caller has that table; else it is built on first use."""
        self._graph = graph
        self._producers: Mapping[str, onnx.NodeProto] | None = producers
        self._initializers: dict[str, onnx.TensorProto] | None = None
        self._values: dict[object, np.ndarray] = {}
        """Values read: per initializer name, and per serialised ``value`` tensor (equal bytes, equal value;
        each SGD node's ``stat`` is a ``ConstantOfShape`` of its own, all of the same value). Never mutated."""
        self._facts: dict[tuple, object] = {}
        """Per test and value (dtype, shape, bytes), and per overload name: what :meth:`holds` and
        :meth:`specialisation` found (a step has a few distinct values and overloads)."""

    def holds(self, test, value: np.ndarray) -> bool:
        """``test(value)``, asked once per distinct value (``test`` a pure function of the array's dtype, shape and
        elements)."""
        key = (test, value.dtype.str, value.shape, value.tobytes())
        known = self._facts.get(key)
        if known is None:
            known = self._facts[key] = bool(test(value))
        return known

    def specialisation(self, overload: str) -> Specialisation | None:
        """``Specialisation.from_overload(overload)`` (a frozen value), None for a name it refuses; once per name."""
        key = ("overload", overload)
        if key not in self._facts:
            try:
                self._facts[key] = Specialisation.from_overload(overload)
            except ValueError:
                self._facts[key] = None
        return self._facts[key]

    def value(self, name: str) -> np.ndarray | None:
        """The constant value of ``name`` as a float64 array (shared between calls: read it, do not change it),
        or None."""
        if self._initializers is None:
            if self._producers is None:
                self._producers = {o: node for node in self._graph.node for o in node.output if o}
            inputs = {i.name for i in self._graph.input}
            self._initializers = {t.name: t for t in self._graph.initializer if t.name not in inputs}
        for _ in range(16):  # a short chain of copies at most
            if name in self._initializers:
                tensor = self._initializers[name]
                if tensor.data_location == onnx.TensorProto.EXTERNAL:
                    return None  # never loaded here
                key = ("initializer", name)
                if key not in self._values:
                    self._values[key] = numpy_helper.to_array(tensor).astype(np.float64)
                return self._values[key]
            node = self._producers.get(name)
            if node is None or node.domain not in ("", "ai.onnx"):
                return None
            if node.op_type in ("Constant", "ConstantOfShape"):
                value = next((a.t for a in node.attribute if a.name == "value"), None)
                if value is None:
                    return np.zeros(1) if node.op_type == "ConstantOfShape" else None
                key = value.SerializeToString()
                if key not in self._values:
                    self._values[key] = numpy_helper.to_array(value).astype(np.float64)
                return self._values[key]
            if node.op_type not in self._KEEP or not node.input:
                return None
            name = node.input[0]
        return None


def _all_positive_zero(value: np.ndarray) -> bool:
    """``value`` has an element and every element is +0 (not -0, not NaN): ``value.size`` and neither
    ``value != 0`` nor ``signbit`` anywhere."""
    return bool(value.size) and not np.any(value != 0) and not np.any(np.signbit(value))


def _all_nonzero(value: np.ndarray) -> bool:
    """``value`` has an element and none equals 0 (NaN does not): ``value.size`` and not ``value == 0`` anywhere."""
    return bool(value.size) and not np.any(value == 0)


def _overload_input_problem(node: onnx.NodeProto, constants: _ConstantInputs) -> str:
    """Why an SGD node's inputs do not meet what its specialised body assumes of them (``stat`` +0 in every
    element, a constant non-zero ``momentum``: :class:`~sgdfuse.fused_op.Specialisation`), or "" when they
    provably do. The body then computes another function than the device op, which reads those inputs:
    onnxruntime's numbers prove nothing about the device (a stat of 1 fed to a ``stat0`` body passed check,
    and the lowered graph skipped dampening)."""
    overload = node.overload
    if not overload:
        return ""
    spec = constants.specialisation(overload)
    if spec is None:
        return ""  # _overload_problem reports it
    inputs = node.input
    assumed = (
        (spec.stat_zero, 5, "stat", _all_positive_zero, "is +0 in every element", "a constant +0",
         "the device op reads stat and onnxruntime's body does not"),
        (spec.momentum_nonzero, 4, "momentum", _all_nonzero, "is a constant other than 0", "one",
         "the device op decides on momentum at run time"),
    )
    for applies, position, role, test, assumes, what, why in assumed:
        if not applies:
            continue
        name = inputs[position] if len(inputs) > position else ""
        value = constants.value(name) if name else None
        if value is None or not constants.holds(test, value):
            return (f"{node.name or 'SGD node'}: its body {overload} assumes {role} {assumes}, but {name or f'its {role}'} "
                    f"is not {what}; {why}, so these numbers prove nothing")
    return ""


def _name_evidence(outputs: Iterable[str], state_names: Iterable[str], pinned: Mapping[str, str] | None = None) -> dict[str, str]:
    """state input → the output the user pinned as its next value (``pinned``: new → old, ``--state NEW=OLD``),
    else the first output whose name marks it as that input's next value."""
    evidence: dict[str, str] = {old: new for new, old in (pinned or {}).items()}
    names = set(state_names)
    for output in outputs:
        previous = previous_by_name(output, names)
        if previous is not None:
            evidence.setdefault(previous, output)
    return evidence


_CLOSURE_LIMIT = 256


def _closure(index: GraphIndex, wanted: Sequence[str], available: set[str]) -> set[int]:
    """Indices of the nodes that compute ``wanted`` from graph inputs, initializers and ``available``
    (at most :data:`_CLOSURE_LIMIT` nodes; values beyond are fed as inputs)."""
    found: set[int] = set()
    stack = list(wanted)
    seen: set[str] = set(available)
    while stack and len(found) < _CLOSURE_LIMIT:
        value = stack.pop()
        if value in seen:
            continue
        seen.add(value)
        producer = index.producer.get(value)
        if producer is None or producer in found:
            continue
        found.add(producer)
        stack.extend(_node_reads(index.graph.node[producer]))
    return found


_INTEGER_TYPES = frozenset({
    onnx.TensorProto.INT8, onnx.TensorProto.INT16, onnx.TensorProto.INT32, onnx.TensorProto.INT64, onnx.TensorProto.UINT8,
    onnx.TensorProto.UINT16, onnx.TensorProto.UINT32, onnx.TensorProto.UINT64, onnx.TensorProto.BOOL,
})


def _shape_producers(index: GraphIndex, indices: set[int]) -> set[int]:
    """Nodes to add to a slice of the nodes ``indices``: each computes only integer or bool values (a ``Shape``,
    ``Size`` or shape arithmetic) that the slice would otherwise take as inputs, from nothing the slice does
    not already read, produce or hold as an initializer; repeated until none is left (at most
    :data:`_CLOSURE_LIMIT` nodes).

    A slice input is fed made-up data, and an integer one zeros (:func:`_feed`): right for class labels, wrong
    for a computed shape such as the ``Shape(p)`` of ``Expand(lr, Shape(p))``, which then makes an empty
    tensor and the original slice fails to run. Computing such a value from what the slice reads adds no
    input and gives both sides the value the graph gives them."""
    nodes = index.graph.node
    found: set[int] = set()
    while len(found) < _CLOSURE_LIMIT:
        members = indices | found
        produced = {o for i in members for o in nodes[i].output if o}
        reads = {name for i in members for name in _node_reads(nodes[i]) if name}
        have = produced | reads
        added = False
        for name in sorted(reads - produced):
            producer = index.producer.get(name)
            if producer is None or producer in found or producer in indices:
                continue
            node = nodes[producer]
            outputs = [o for o in node.output if o]
            if not all(index.spec(o).dtype in _INTEGER_TYPES for o in outputs):
                continue
            if all(r in have or r in index.initializers for r in _node_reads(node) if r):
                found.add(producer)
                added = True
        if not added:
            break
    return found


def _classify_inputs(index: GraphIndex, names: Sequence[str], views: Sequence[_UpdateView], plans: Sequence, nodes) -> list[_Input]:
    state_roles: dict[str, str] = {}
    for view in views:
        for state, role in view.roles.items():
            state_roles[state] = "parameters" if role == "w" else "accum"
        state_roles.setdefault(view.parameters, "parameters")
        state_roles.setdefault(view.accum, "accum")
    coefficients = {
        symbol
        for plan in plans
        for poly in (plan.match.learning_rate, plan.match.momentum)
        for monomial in poly.terms
        for symbol, _ in monomial
    }
    gradient_sources = _sources([view.gradient for view in views], nodes)
    inputs = []
    for name in names:
        spec = index.spec(name)
        if spec.shape is None or any(d is None for d in spec.shape):
            raise ValueError(f"cannot verify: the shape of {name} is unknown")
        role = state_roles.get(name) or (
            "coefficient" if name in coefficients else "gradient" if name in gradient_sources else "other"
        )
        inputs.append(_Input(name, spec.dtype, tuple(spec.shape), role))
    return inputs


def _sources(values: Iterable[str], nodes: Sequence[onnx.NodeProto], producer: Mapping[str, onnx.NodeProto] | None = None) -> set[str]:
    """``values`` and every value they are computed from within ``nodes`` (subgraphs' outer reads included);
    ``producer``: output → node of ``nodes``, when the caller asks many times of one graph."""
    if producer is None:
        producer = {o: node for node in nodes for o in node.output if o}
    found: set[str] = set()
    stack = list(values)
    while stack:
        value = stack.pop()
        if value in found:
            continue
        found.add(value)
        node = producer.get(value)
        if node is not None:
            stack.extend(name for name in _node_reads(node) if name)
    return found


@dataclasses.dataclass
class _Parts:
    """What a slice model is built from: its nodes (in order), its own initializers, its outputs, its opset
    imports and, for a fused slice, the opset of the SGD function it carries (None: no function); after
    :func:`_parts_inputs`, the initializers it reads from the graph and its inputs too."""

    nodes: list[onnx.NodeProto]
    initializers: list[onnx.TensorProto]
    outputs: list[str]
    opset_import: list[onnx.OperatorSetIdProto]
    function_opset: int | None
    needed_initializers: list[onnx.TensorProto] = dataclasses.field(default_factory=list)
    inputs: list[str] = dataclasses.field(default_factory=list)


def _parts_inputs(index: GraphIndex, parts: _Parts) -> tuple[_Parts, list[str]]:
    """``parts`` with the inputs of the slice (every value its nodes read that nothing in it defines) and the
    graph initializers it embeds; returns the parts and the inputs."""
    produced = {o for node in parts.nodes for o in node.output if o}
    own = {t.name for t in parts.initializers}
    needed_initializers: list[onnx.TensorProto] = list(parts.initializers)
    inputs: list[str] = []
    listed: set[str] = set()
    for node in parts.nodes:
        for name in _node_reads(node):  # subgraph bodies read outer values too
            if not name or name in produced or name in own or name in listed:
                continue
            tensor = index.initializers.get(name)
            # An initializer whose data is external (not loaded) is fed like an input: onnxruntime would
            # resolve its location against the current directory, unchecked (sgdfuse.external_data).
            if tensor is not None and not index.is_input_name(name) and tensor.data_location != onnx.TensorProto.EXTERNAL:
                needed_initializers.append(tensor)
                own.add(name)
            else:
                inputs.append(name)
                listed.add(name)
    parts.needed_initializers, parts.inputs = needed_initializers, inputs
    return parts, inputs


def _slice_model(index: GraphIndex, parts: _Parts) -> tuple[onnx.ModelProto, list[str]]:
    """A model of ``parts``' nodes whose inputs are every value they read that nothing in the slice defines."""
    parts, inputs = _parts_inputs(index, parts)
    graph = helper.make_graph(
        list(parts.nodes),
        "sgdfuse_slice",
        [_value_info(index, name) for name in inputs],
        [helper.make_empty_tensor_value_info(name) for name in parts.outputs],
        initializer=parts.needed_initializers,
    )
    model = helper.make_model(graph, opset_imports=list(parts.opset_import))
    model.ir_version = max(model.ir_version, 8)
    if parts.function_opset is not None:
        # The fused side runs the bodies the output model will call (specialised overloads need IR 10).
        model.functions.extend(sgd_functions_for(parts.nodes, parts.function_opset))
        model.ir_version = max(model.ir_version, OVERLOAD_IR_VERSION)
    return model, inputs


def _value_info(index: GraphIndex, name: str) -> onnx.ValueInfoProto:
    spec = index.spec(name)
    return helper.make_tensor_value_info(name, spec.dtype, None if spec.shape is None else list(spec.shape))


# ------------------------------------------------------------------------------------------- running


class _RunError(Exception):
    """onnxruntime failed on one side of a run: ``side`` says which in words ("original slice", "fused model",
    ...), ``original`` whether it is the original's (then the run proves nothing about the rewrite and is
    skipped where the callers say so). Callers test ``original``, never the words: a test of ``side ==
    "original"`` never matched "original slice", so a size the original slice cannot run failed the update."""

    def __init__(self, side: str, error: BaseException) -> None:
        super().__init__(f"the {side} could not run: {str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__}")
        self.side = side
        self.original = side.split()[0] == "original"


_INPUT_NAMES: "weakref.WeakKeyDictionary[object, frozenset[str]]" = weakref.WeakKeyDictionary()


def _input_names(session) -> frozenset[str]:
    """The input names of ``session``, read once per session (``get_inputs`` builds its ``NodeArg`` s anew at
    every call, and a schedule runs each session about 17 times); not cached for a session that cannot be
    weakly referenced."""
    try:
        return _INPUT_NAMES[session]
    except (KeyError, TypeError):
        pass
    names = frozenset(i.name for i in session.get_inputs())
    try:
        _INPUT_NAMES[session] = names
    except TypeError:
        pass
    return names


def _run_side(session, feeds: Mapping[str, np.ndarray], names: Sequence[str], side: str) -> dict[str, np.ndarray]:
    wanted = _input_names(session)
    try:
        return run(session, {k: v for k, v in feeds.items() if k in wanted}, names)
    except Exception as error:  # onnxruntime's own exception types
        raise _RunError(side, error) from error


def _scalar(array) -> float:
    values = np.asarray(array, dtype=np.float64).reshape(-1)
    return float(values[0]) if values.size else 0.0


def _state_difference(original, fused) -> np.ndarray | float:
    """|fused - original| of a state both sides read (Inf where their shapes differ: already a failure)."""
    if fused is None:
        return 0.0
    if np.shape(original) != np.shape(fused):
        return float("inf")
    return difference(original, fused)


def _view_terms(view: _UpdateView, original_feeds, fused_feeds, original_out, fused_out, *, carried: bool = False) -> _Terms:
    """The bound's values for one update in one step (module docstring, "Values"). With ``carried`` (``check``'s
    in-place run, each side carrying its own state) and the original's gradient probed, the two gradients
    (each computed from its side's weights) give ``dg`` and ``g`` the larger magnitude of the two; so, on every
    step, do the two sides' values of a gradient that is another update's output (:attr:`_UpdateView.upstream_gradient`)."""
    gradient = _gradient_of(view, original_feeds, original_out, fused_out)
    p = original_feeds[view.parameters]
    a = original_feeds[view.accum]
    dp = _state_difference(p, fused_feeds.get(view.parameters))
    da = _state_difference(a, fused_feeds.get(view.accum))
    dg: np.ndarray | float = 0.0
    if view.upstream_gradient:
        # A gradient computed from (or that is) another update's output: each side reads its own value of it,
        # the fused one by its probe in check, by its name in verify_plans (:attr:`_UpdateView.upstream_gradient`).
        original_gradient = original_out.get(view.original_gradient or view.upstream_gradient)
        fused_gradient = gradient if view.gradient_side == "fused" else fused_out.get(view.upstream_gradient)
    elif view.negated_upstream:
        # The fused node reads Neg(y) of another update's output y: the original's counterpart is -y of its run.
        upstream = original_out.get(view.negated_upstream)
        original_gradient = None if upstream is None else np.negative(upstream)
        fused_gradient = gradient
    else:
        original_gradient = original_out.get(view.original_gradient) if carried and view.original_gradient else None
        fused_gradient = gradient
    if (original_gradient is not None and fused_gradient is not None and gradient is not None
            and np.shape(original_gradient) == np.shape(gradient) == np.shape(fused_gradient)):
        with np.errstate(invalid="ignore"):
            dg = difference(original_gradient, fused_gradient)
            # A NaN or Inf on one side only is no allowance: the outputs it reaches then differ and fail.
            dg = np.where(np.isfinite(dg), dg, 0.0)
            gradient = np.maximum(np.abs(_float_array(gradient)), np.maximum(
                np.abs(_float_array(original_gradient)), np.abs(_float_array(fused_gradient))))
    return _Terms(
        p=p, g=gradient, a=a, lr=_scalar(fused_out[view.learning_rate]), m=_scalar(fused_out[view.momentum]),
        d=view.dampening, wd=view.weight_decay, nesterov=view.nesterov, dtype=view.dtype, dp=dp, da=da, dg=dg,
        exact=view.exact_coefficients,
    )


def _gradient_of(view: _UpdateView, original_feeds, original_out, fused_out):
    """The gradient ``view``'s update reads in one step: the fused SGD node's operand (``check``, its probe) or
    the original's gradient, computed or fed (``verify_plans``); None when the run has neither."""
    if view.gradient_side == "fused":
        return fused_out.get(view.gradient)
    return original_out.get(view.gradient, original_feeds.get(view.gradient))


def _view_live(view: _UpdateView, original_feeds, original_out, fused_out) -> bool:
    """Did ``view``'s gradient take part in this step's comparison (:func:`gradient_live` over the update's
    outputs and state writes on both sides)?"""
    names = dict.fromkeys([*view.outputs, *view.original_state.values(), *view.fused_state.values()])
    compared = [side[name] for side in (original_out, fused_out) for name in names if name in side]
    return gradient_live(_gradient_of(view, original_feeds, original_out, fused_out), compared)


def _live_views(views: Sequence[_UpdateView], steps: Sequence[tuple], known: Sequence[bool]) -> list[bool]:
    """Per view: was its gradient live (:func:`_view_live`) on one of ``steps``, each ``(original feeds,
    original outputs, fused outputs)``, or is it ``known`` to be (from an earlier run)? Stops at the first
    step where it was."""
    return [seen or any(_view_live(view, *step) for step in steps) for view, seen in zip(views, known)]


def _lazy_bounds(view: _UpdateView, original_feeds, fused_feeds, original_out, fused_out, *, lifted: bool,
                 carried: bool = False) -> dict:
    """``{"w": bound, "v": bound}`` as callables computing both bounds once, when first needed (most
    comparisons are bit for bit equal and need none); ``carried`` as for :func:`_view_terms`."""
    cache: list = []

    def get(role: str):
        def compute():
            if not cache:
                terms = _view_terms(view, original_feeds, fused_feeds, original_out, fused_out, carried=carried)
                cache.append(dict(zip("wv", _bounds(terms, lifted=lifted))))
            return cache[0][role]

        return compute

    return {"w": get("w"), "v": get("v")}


def _compare_step(
    views: Sequence[_UpdateView], tallies: Sequence[_Tally], label: str, original_feeds, fused_feeds, original_out, fused_out,
    *, lifted: bool, outputs: bool = True, in_place: bool = True, finite_only: bool = False,
) -> None:
    """Compare one step of every update: its outputs and the values each side writes into its state (with
    ``finite_only``, a :data:`WIDE` step: elements not finite on either side left out)."""
    for view, tally in zip(views, tallies):
        bounds = _lazy_bounds(view, original_feeds, fused_feeds, original_out, fused_out, lifted=lifted)
        if outputs:
            for name, role in view.outputs.items():
                tally.compare(f"{label}: {name}", original_out[name], fused_out[name], bounds[role], finite_only=finite_only)
        if in_place:
            for state, role in view.roles.items():
                original_next = view.original_state.get(state)
                fused_next = view.fused_state.get(state)
                want = original_out[original_next] if original_next else original_feeds[state]
                have = fused_out[fused_next] if fused_next else fused_feeds[state]
                tally.compare(
                    f"{label}: in place, {state} becomes {fused_next or state} on the fused side and "
                    f"{original_next or state + ' (unchanged)'} in the original",
                    want, have, bounds[role], finite_only=finite_only,
                )


def _carry(feeds: dict, out: Mapping[str, np.ndarray], pairs: Mapping[str, str]) -> None:
    for state, output in pairs.items():
        if output in out:
            feeds[state] = out[output]


# --------------------------------------------------------------------------------------- verify_plans


def verify_plans(
    model: onnx.ModelProto,
    index: GraphIndex,
    plans: Sequence,
    *,
    steps: int = 3,
    seed: int = 0,
    shared: dict[str, onnx.TensorProto] | None = None,
    pinned: Mapping[str, str] | None = None,
) -> list[UpdateCheck]:
    """Run the original and the fused slices of ``plans`` in place, natively and lifted, at every size,
    over the schedule of the module docstring; one result per plan, in order. ``pinned`` (output → the input
    it replaces, the user's ``--state``) decides which original output is carried into a state before names.

    From :data:`CLASS_MIN_PLANS` plans on, plans are grouped into classes whose single-plan slices are
    identical up to value names: plans of one structural class of the matcher (``Match.structural_class``,
    whose original cones are renamings of each other) whose own nodes agree up to names (:func:`_plan_digest`),
    else by the digest of their whole slices (:func:`_slice_class_key`); per class the first plan and a seeded random
    sample of up to :data:`CLASS_SAMPLE` others are run, and when every one of them passes, each other member
    gets that result with ``verified_as`` naming the first plan. A class with a failing run has every member
    run. Why this is sound: the two slices of a member are the representative's with every value renamed by
    one bijection (operators, attributes, constant values and dtypes, input dtypes and shapes, the order of
    nodes, what is compared and which value is written in place into which state all equal), so onnxruntime
    computes the same numbers on both and every comparison of the check has the same outcome. A plan whose
    slices cannot be keyed (a subgraph, an error building them) is run itself.

    Args:
        model: the model the plans apply to; ``index`` its index.
        plans: :class:`sgdfuse.passes.rewrite.Plan` s.
        steps: chained steps per precision and size (at least 1).
        seed: seed of the random inputs (and of the class samples).
        shared: the scalar initializers of every plan (plans share constants: the plan that made one owns
            it), so that a batch can include what its plans read; computed from ``plans`` when not given.
    """
    if not plans:
        return []
    if shared is None:
        shared = {t.name: t for plan in plans for t in plan.initializers}
    inconsistent = {k: problem for k, plan in enumerate(plans) if (problem := _overload_problem(plan.sgd_node))}
    if inconsistent:
        # onnxruntime runs the overload's body, GE the attributes: a node whose two disagree is never kept.
        rest = [plan for k, plan in enumerate(plans) if k not in inconsistent]
        checked = iter(verify_plans(model, index, rest, steps=steps, seed=seed, shared=shared, pinned=pinned))
        return [
            UpdateCheck(plan.match.parameters_out, 0, False, float("nan"), float("nan"), inconsistent[k]) if k in inconsistent else next(checked)
            for k, plan in enumerate(plans)
        ]
    if shared is None:
        shared = {t.name: t for plan in plans for t in plan.initializers}
    evidence = _name_evidence(index.graph_outputs, index.state_names, pinned)
    if len(plans) < CLASS_MIN_PLANS:
        return _verify_each(model, index, plans, steps=steps, seed=seed, shared=shared, evidence=evidence)
    classes: dict[object, list[int]] = {}
    for k, plan in enumerate(plans):
        structural = getattr(plan.match, "structural_class", None)
        # The matcher's structural class says the original cones are a renaming of its first member's
        # (docs/design.md, "Matching per structural class"); the digest of the plan's own nodes says the same
        # of the rewrite. Other plans are keyed by their whole slices.
        if structural is not None:
            key = ("structural", structural, _plan_digest(plan, shared))
        else:
            key = _slice_class_key(model, index, plan, shared, evidence)
        classes.setdefault(("own", k) if key is None else key, []).append(k)
    sampler = random.Random(seed)
    chosen: set[int] = set()
    for members in classes.values():
        chosen.add(members[0])
        chosen.update(sampler.sample(members[1:], min(CLASS_SAMPLE, len(members) - 1)))
    results = _run_chosen(model, index, plans, sorted(chosen), steps=steps, seed=seed, shared=shared, evidence=evidence)
    unrun: list[int] = []
    for members in classes.values():
        ran = [results[k] for k in members if k in results]
        if all(check.passed for check in ran):
            first = results[members[0]]
            for k in members:
                if k not in results:
                    results[k] = dataclasses.replace(first, parameters_out=plans[k].match.parameters_out, verified_as=first.parameters_out)
        else:
            unrun.extend(k for k in members if k not in results)
    results.update(_run_chosen(model, index, plans, sorted(unrun), steps=steps, seed=seed + 1, shared=shared, evidence=evidence))
    logger.info("verified %d plans in %d classes by running %d", len(plans), len(classes), len(chosen) + len(unrun))
    return [results[k] for k in range(len(plans))]


CLASS_MIN_PLANS = 64
"""From this many plans on, :func:`verify_plans` runs a sample per class of identical slices."""

CLASS_SAMPLE = 2
"""Members run per class besides its first (seeded random choice)."""


def _run_chosen(model, index, plans: Sequence, chosen: Sequence[int], *, steps: int, seed: int, shared, evidence=None) -> dict[int, UpdateCheck]:
    checks = _verify_each(model, index, [plans[k] for k in chosen], steps=steps, seed=seed, shared=shared, evidence=evidence) if chosen else []
    return dict(zip(chosen, checks))


def _plan_digest(plan, shared: Mapping[str, onnx.TensorProto]) -> bytes:
    """A digest of ``plan``'s new nodes (op, domain, overload, attributes, value names replaced by their order
    of first appearance) and of the scalar initializers they read (dtype, dims, bytes): two plans with equal
    digests rewrite their cones alike, up to names. A subgraph attribute keeps its own names, so plans with
    one get digests of their own."""
    names: dict[str, str] = {}

    def rename(name: str) -> str:
        return names.setdefault(name, f"v{len(names)}") if name else ""

    described: list = [plan.sgd_node.doc_string]
    for node in plan.nodes:
        described.append((
            node.op_type, node.domain, node.overload, [rename(n) for n in node.input], [rename(n) for n in node.output],
            [a.SerializeToString(deterministic=True) for a in node.attribute],
        ))
        for name in node.input:
            tensor = shared.get(name)
            if tensor is not None:
                anonymous = onnx.TensorProto()
                anonymous.CopyFrom(tensor)
                anonymous.name = ""
                described.append(("initializer", rename(name), anonymous.SerializeToString(deterministic=True)))
    return hashlib.sha256(_encoded(described)).digest()


def _slice_class_key(model, index: GraphIndex, plan, shared, evidence: Mapping[str, str]) -> bytes | None:
    """A digest of ``plan``'s original and fused slices (:func:`_build_slices` of the plan alone) with every
    value name replaced by its order of first appearance: equal digests mean slices equal up to one
    renaming. Node names, doc strings and metadata (no effect on the numbers) are left out; operators,
    domains, attributes, initializers (dtype, dims, bytes), graph input types and shapes, the slice inputs'
    roles, the compared outputs, the in-place pairs, coefficients and dtypes of each view are in. None when
    the slices have a subgraph (its outer reads would need renaming too) or cannot be built."""
    try:
        slices = _build_slices(model, index, [plan], shared, evidence, models=False)
    except Exception:  # the plan is run alone, where its error is reported
        return None
    names: dict[str, int] = {}
    rename = _renamer(names)
    digest = hashlib.sha256()
    for parts in (slices.original, slices.fused):
        described = _describe_parts(parts, index.spec, names)
        if described is None:
            return None
        digest.update(_encoded(described))
    described = [
        [(rename(spec.name), spec.dtype, spec.shape, spec.role) for spec in slices.inputs],
        [rename(name) for name in slices.original_outputs],
        [rename(name) for name in slices.fused_outputs],
    ]
    described.extend(_describe_view(view, rename) for view in slices.views)
    digest.update(_encoded(described))
    return digest.digest()


def _describe_view(view: _UpdateView, rename) -> list:
    """What is compared for one update and how, with value names replaced by ``rename``."""
    return [
        sorted((rename(k), v) for k, v in view.outputs.items()),
        sorted((rename(k), rename(v)) for k, v in view.original_state.items()),
        sorted((rename(k), rename(v)) for k, v in view.fused_state.items()),
        sorted((rename(k), v) for k, v in view.roles.items()),
        [rename(n) for n in (view.parameters, view.accum, view.gradient, view.learning_rate, view.momentum)],
        view.gradient_side, repr(view.dampening), repr(view.weight_decay), view.nesterov, view.dtype,
        rename(view.original_gradient) if view.original_gradient else "",
        rename(view.upstream_gradient) if view.upstream_gradient else "",
        rename(view.negated_upstream) if view.negated_upstream else "",
    ]


def _describe_parts(parts: _Parts, spec_of, names: dict[str, int], cache: dict | None = None) -> list | None:
    """What a slice computes, with every value name replaced by its number in ``names`` (its order of first
    appearance, :func:`_renamer`; "" is -1):
    opsets, input dtypes and shapes, initializers (dtype, dims, bytes; names and doc strings left out), each
    node's operator, domain, overload, attributes, number of inputs, renamed inputs and outputs, the outputs. None when a
    node has a subgraph (its outer reads would need renaming too). Shared by :func:`_slice_class_key` and
    :func:`check_models`' classes of groups. ``cache`` (keyed by object id: only for protos that outlive
    it) keeps each node's and initializer's description for the next slice that has it."""
    interned = cache is not None
    cache = {} if cache is None else cache
    rename = _renamer(names)
    setdefault = names.setdefault
    described: list = [[(o.domain, o.version) for o in parts.opset_import], parts.function_opset]
    for name in parts.inputs:
        spec = spec_of(name)
        described.append(("input", rename(name), spec.dtype, spec.shape))
    for tensor in parts.needed_initializers:
        value = cache.get(id(tensor))
        if value is None:
            value = cache[id(tensor)] = _intern(cache, ("initializer", _anonymous_bytes(tensor))) if interned else _anonymous_bytes(tensor)
        described.append(("initializer", rename(tensor.name), value))
    for node in parts.nodes:
        entry = cache.get(id(node))
        if entry is None:
            attributes = node.attribute
            if attributes and (node.domain, node.op_type) not in _NO_SUBGRAPHS and any(
                a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in attributes
            ):
                return None
            # The number of inputs tells Dropout(x, "") -> y from Dropout(x) -> ("", y): the values list
            # below marks an omitted name and its separator alike (-1).
            what = (node.op_type, node.domain, node.overload, tuple(a.SerializeToString(deterministic=True) for a in attributes) if attributes else (), len(node.input))
            entry = cache[id(node)] = (_intern(cache, what) if interned else what, tuple(node.input) + ("",) + tuple(node.output))
        what, values = entry
        if "" in names:
            # The common case, one comprehension: a name not yet numbered gets the next number (setdefault
            # evaluates len(names) before inserting), and "" keeps the -1 it was given below.
            renamed = [setdefault(name, len(names)) for name in values]
        else:
            renamed = []
            for name in values:  # inputs, "" (-1), outputs: the numbers of first appearance, inline
                number = names.get(name)
                if number is None:
                    number = names[name] = len(names) if name else -1
                renamed.append(number)
        described.append((what, renamed))
    described.append(("outputs", [rename(n) for n in parts.outputs]))
    return described


def _encoded(described: list) -> bytes:
    """``described`` (a description of :func:`_describe_parts` or :func:`_describe_view`) as bytes that are equal
    exactly when the descriptions are equal in value and type, for a digest.

    ``marshal`` at version 2 writes no back-references (later versions refer to an object seen before by
    identity, so equal descriptions could encode differently), keeps ``True`` apart from ``1`` and ``0.0``
    from ``-0.0`` (floats in binary), and is several times faster than ``repr``. A description holding a type
    marshal cannot write (a numpy scalar in a shape) is written by ``repr``, behind a tag that marshal's output
    never starts with, so the two encodings never coincide (at worst equal slices fall in two classes, each
    run: slower, never unsound)."""
    try:
        return marshal.dumps(described, 2)
    except ValueError:
        return b"\x00repr:" + repr(described).encode()


def _renamer(names: dict[str, int]):
    """``name → its number``: the order in which names are first seen (``names`` is filled), "" → -1."""

    def rename(name: str) -> int:
        number = names.get(name)
        if number is None:
            number = names[name] = len(names) if name else -1
        return number

    return rename


def _intern(cache: dict, content: tuple) -> int:
    """A number standing for ``content`` in every description made with ``cache``: equal numbers for equal
    contents, distinct numbers for distinct ones (a dictionary of the contents themselves, no hash is trusted)."""
    table = cache.setdefault("interned", {})
    return table.setdefault(content, len(table))


def _anonymous_bytes(tensor: onnx.TensorProto) -> bytes:
    """``tensor`` serialised without its name and doc string (what its value is, not what it is called)."""
    anonymous = onnx.TensorProto()
    anonymous.CopyFrom(tensor)
    anonymous.name = ""
    anonymous.doc_string = ""
    return anonymous.SerializeToString(deterministic=True)

def _verify_each(
    model: onnx.ModelProto,
    index: GraphIndex,
    plans: Sequence,
    *,
    steps: int,
    seed: int,
    shared: dict[str, onnx.TensorProto],
    evidence: Mapping[str, str] | None = None,
) -> list[UpdateCheck]:
    """:func:`verify_plans` with every plan run itself.

    A batch whose run raises is split in two and each half checked alone, down to single plans; a single
    plan that still cannot run is reported as not passed with the error.

    Args:
        model: the model the plans apply to; ``index`` its index.
        plans: :class:`sgdfuse.passes.rewrite.Plan` s.
        steps: chained steps per precision and size (at least 1).
        seed: seed of the random inputs.
        shared: the scalar initializers of every plan (plans share constants: the plan that made one owns
            it), so that a batch can include what its plans read.
        evidence: :func:`_name_evidence` of the graph (computed per batch when None).
    """
    if not plans:
        return []
    if len(plans) > BATCH_UPDATES:
        # onnxruntime's session creation grows faster than linearly with the graph: check in fixed-size
        # batches so the whole check stays linear in the number of updates.
        results: list[UpdateCheck] = []
        for start in range(0, len(plans), BATCH_UPDATES):
            results.extend(_verify_each(model, index, plans[start : start + BATCH_UPDATES], steps=steps, seed=seed + start, shared=shared, evidence=evidence))
        return results
    try:
        return _verify_batch(model, index, plans, steps=steps, seed=seed, shared=shared, evidence=evidence)
    except Exception as error:  # one bad slice must not sink the others: bisect
        if len(plans) == 1:
            return [UpdateCheck(plans[0].match.parameters_out, 0, False, float("nan"), float("nan"), f"could not run: {error}")]
        logger.info("batched verification failed (%s); verifying the batch in halves", error)
        half = len(plans) // 2
        return _verify_each(model, index, plans[:half], steps=steps, seed=seed, shared=shared, evidence=evidence) + _verify_each(
            model, index, plans[half:], steps=steps, seed=seed, shared=shared, evidence=evidence
        )


def _verify_batch(model, index, plans, *, steps: int, seed: int, shared, evidence=None) -> list[UpdateCheck]:
    slices = _build_slices(model, index, plans, shared, evidence)
    pairs, note, ops = _make_pairs(slices.original, slices.fused)
    if ops and len(plans) > 1:
        # Only the updates whose slices use an op without a DOUBLE kernel lose the lifted run.
        affected = [any(node.op_type in ops for node in _plan_nodes(index, plan)) for plan in plans]
        if any(affected) and not all(affected):
            groups = ([p for p, a in zip(plans, affected) if not a], [p for p, a in zip(plans, affected) if a])
            checked = {id(p): c for group in groups for p, c in zip(group, _verify_each(model, index, group, steps=steps, seed=seed, shared=shared, evidence=evidence))}
            return [checked[id(p)] for p in plans]
    tallies = [_Tally() for _ in plans]
    if note:
        for tally in tallies:
            tally.note(note)
    fed = {spec.name for spec in slices.inputs}
    producer = {o: node for node in slices.original.graph.node for o in node.output if o}
    state = {spec.name for spec in slices.inputs if spec.role in ("parameters", "accum")}
    isolable = _isolable_inputs(slices.views, lambda view: _sources([view.gradient], (), producer) & fed, state)
    for pair in pairs:
        for size in _sizes(slices.inputs):
            try:
                _run_schedule(pair, slices, tallies, steps=steps, size=size, seed=seed, isolating=_isolating_pair(pair, pairs),
                              isolable=isolable)
            except _RunError as error:
                if len(plans) > 1:
                    raise
                if error.original:
                    tallies[0].note(f"{_run_label(pair.label, size)}: {error} (the original cannot run here; skipped)")
                else:
                    tallies[0].fail(f"{_run_label(pair.label, size)}: {error}")
    results = []
    for plan, view, tally in zip(plans, slices.views, tallies):
        if tally.passed and not tally.runs:
            tally.fail("no size at which the original slice runs: " + "; ".join(tally.notes))
        if tally.passed and not tally.gradient_seen:
            fed = {spec.name for spec in slices.inputs}
            sources = sorted((_sources([view.gradient], slices.original.graph.node) & fed) - {view.gradient})
            tally.fail(dead_gradient_message(
                plan.match.gradient, sources, [plan.match.parameters_out, plan.match.accum_out],
                "the slice run for this update computes its gradient (a guard of the update reads it) from inputs "
                "that the random data never brings to a non-zero gradient, so the update is left unfused",
            ))
        results.append(
            UpdateCheck(plan.match.parameters_out, steps, tally.passed, tally.max_abs, tally.max_ratio, tally.message, tally.runs, "; ".join(tally.notes))
        )
    return results


def dead_gradient_message(gradient: str, sources: Sequence[str], outputs: Sequence[str], advice: str) -> str:
    """Why an update whose gradient was never live (:data:`WIDE`) fails: its gradient, what it is computed
    from, the outputs whose gradient term was never compared, and ``advice`` (what can be done)."""
    computed = ""
    if sources:
        shown = ", ".join(sources[:3]) + (f" and {len(sources) - 3} more" if len(sources) > 3 else "")
        computed = f" (computed from {shown})"
    return (
        f"the gradient {gradient}{computed} was zero or not finite at every element of every step, wide-range inputs "
        f"included, so the gradient term of {' and '.join(outputs)} was never compared and these runs do not show the "
        f"update right; {advice}"
    )


def _plan_nodes(index: GraphIndex, plan) -> list[onnx.NodeProto]:
    return [index.graph.node[i] for i in sorted(plan.match.nodes)] + list(plan.nodes)


def _run_schedule(pair: _Pair, slices: _Slices, tallies: Sequence[_Tally], *, steps: int, size: int | None, seed: int,
                  isolating: bool = True, isolable: frozenset[str] = frozenset()) -> None:
    """One precision at one size: ``steps`` chained in-place steps, then the extreme-value steps, then (with
    ``isolating``) the :data:`ISOLATING_KINDS` steps (:func:`_isolating_kinds`, ``isolable`` as for
    :func:`_isolable_inputs`), then, when some update's gradient was not live on any of them, the :data:`WIDE`
    step."""
    rng = np.random.default_rng(seed)
    convert = _lifted_array if pair.lifted else (lambda array: array)
    original_pairs = {s: o for view in slices.views for s, o in view.original_state.items()}
    fused_pairs = {s: o for view in slices.views for s, o in view.fused_state.items()}
    state = [spec for spec in slices.inputs if spec.role in ("parameters", "accum")]
    others = [spec for spec in slices.inputs if spec.role not in ("parameters", "accum")]
    initial = {spec.name: convert(_state_initial(spec, size, rng)) for spec in state}
    original_feeds, fused_feeds = dict(initial), dict(initial)
    label = _run_label(pair.label, size)
    completed: list[tuple] = []
    kinds = _schedule(steps)
    isolating_rng = _isolating_rng(seed)
    isolating_kinds = _isolating_kinds(isolating, slices.inputs, isolable)

    def run_step(step: int, kind: str) -> None:
        step_rng = isolating_rng if kind in ISOLATING_KINDS else rng
        for spec in others:
            value = convert(_feed(spec, kind, _counter(kind, step, len(kinds)), size, step_rng, isolable=spec.name in isolable))
            original_feeds[spec.name] = fused_feeds[spec.name] = value
        original_out = _run_side(pair.original, original_feeds, slices.original_outputs, "original slice")
        fused_out = _run_side(pair.fused, fused_feeds, slices.fused_outputs, "fused slice")
        completed.append((original_feeds, fused_feeds, original_out, fused_out, f"{label}, step {step + 1} ({kind})", kind))

    for step, kind in enumerate(kinds + list(EXTRA_KINDS) + isolating_kinds):
        unchained = kind in EXTRA_KINDS or kind in ISOLATING_KINDS
        if unchained and step == len(kinds):
            base = (dict(original_feeds), dict(fused_feeds))
        if unchained:
            original_feeds, fused_feeds = dict(base[0]), dict(base[1])
        if kind == "restart":
            _random_buffers(state, original_feeds, fused_feeds, size, rng, convert, only_zero=True)
        if kind in ISOLATING_KINDS:
            _isolating_state(kind, state, original_feeds, fused_feeds, size, isolating_rng, convert, isolable)
        run_step(step, kind)
        if not unchained:
            original_feeds, fused_feeds = dict(original_feeds), dict(fused_feeds)
            _carry(original_feeds, completed[-1][2], original_pairs)
            _carry(fused_feeds, completed[-1][3], fused_pairs)
    live = _live_views(slices.views, [(o_in, o_out, f_out) for o_in, _, o_out, f_out, _, _ in completed],
                       [tally.gradient_seen for tally in tallies])
    if not all(live):
        # A gradient computed in the slice (a guard reading it brings its cone in) that the random data kept at zero.
        original_feeds, fused_feeds = dict(base[0]), dict(base[1])
        _random_buffers(state, original_feeds, fused_feeds, size, rng, convert)
        try:
            run_step(len(kinds) + len(EXTRA_KINDS) + len(isolating_kinds), WIDE)
        except _RunError as error:
            if not error.original:
                raise  # the fused slice fails where the original runs: a failure, as on any step
            for tally in tallies:
                tally.note(f"{label}: the wide-range step could not run: {error} (skipped)")
        else:
            o_in, _, o_out, f_out, _, _ = completed[-1]
            live = [seen or _view_live(view, o_in, o_out, f_out) for view, seen in zip(slices.views, live)]
    # Compare only once every run of this precision and size succeeded (a run error skips the size whole).
    for original_in, fused_in, original_out, fused_out, step_label, kind in completed:
        _compare_step(slices.views, tallies, step_label, original_in, fused_in, original_out, fused_out, lifted=pair.lifted,
                      finite_only=kind == WIDE)
    for tally, seen in zip(tallies, live):
        tally.runs.append(label)
        tally.gradient_seen = tally.gradient_seen or seen


def _random_buffers(specs: Iterable[_Input], original_feeds: dict, fused_feeds: dict, size: int | None,
                    rng: np.random.Generator, convert, *, only_zero: bool = False) -> None:
    """Feed every momentum buffer among ``specs`` (role ``accum``) random values, the same on both sides
    (:data:`RANDOM_STATE`, :data:`WIDE`). With ``only_zero`` (a restart step) only a buffer that is zero
    everywhere on both sides: where the gradient was zero on the fed data the chain leaves the buffer at zero,
    and a first step that ignores the old buffer is then not seen to ignore it."""
    for spec in specs:
        if spec.role != "accum" or spec.name not in original_feeds:
            continue
        if only_zero and (np.any(original_feeds[spec.name]) or np.any(fused_feeds.get(spec.name, 1.0))):
            continue
        original_feeds[spec.name] = fused_feeds[spec.name] = convert(_random_state(spec, size, rng))


# --------------------------------------------------------------------------------------- check_models


@dataclasses.dataclass
class ModelCheck:
    """The result of :func:`check_models`.

    Attributes:
        steps: chained steps run per precision and size.
        passed: every output agreed and every in-place state write agreed, at every step.
        outputs: per graph output: ``{"name", "kind" ("fused update" or "exact"), "max_abs_error",
            "max_bound_ratio", "passed", "message"}``.
        state_pairs: the original's state pairs: graph output → the graph input it is the next value of.
        in_place: per state input an SGD node writes: ``{"name", "kind" ("in place"), "original" (the
            original's next value), "fused" (what the fused op writes), "max_abs_error", "max_bound_ratio",
            "passed", "message"}``.
        runs: what was run (precision and size).
        note: what could not be run and why, and which output was carried into a state several outputs are named after; or "".
        groups: independent groups of outputs the models were cut into (:func:`check_models`).
        groups_run: how many of them were run; each other one has the results of a run member of its class,
            named by the ``verified_as`` of its entries in ``outputs`` and ``in_place`` ("" where run).
        uncompared: the outputs and state inputs that failed because nothing about them was compared: an
            update's output that is NaN or infinite everywhere, and the outputs and state writes of an update
            whose gradient was zero or not finite at every element of every step (:data:`WIDE`).
    """

    steps: int
    passed: bool
    outputs: list[dict]
    state_pairs: dict[str, str]
    in_place: list[dict] = dataclasses.field(default_factory=list)
    runs: list[str] = dataclasses.field(default_factory=list)
    note: str = ""
    groups: int = 0
    groups_run: int = 0
    uncompared: list[str] = dataclasses.field(default_factory=list)


def check_models(
    original: onnx.ModelProto, fused: onnx.ModelProto, *, steps: int = 3, seed: int = 0, pinned: Mapping[str, str] | None = None,
    node_tables: tuple[NodeTable, NodeTable] | None = None,
) -> ModelCheck:
    """Run two whole models (an original and its fused form) in onnxruntime, natively and lifted to DOUBLE,
    at every size, over the schedule of the module docstring: once in lockstep (both fed the original's
    state) and once in place (each side carrying its own state).

    Fused pairs come from the fused model's SGD nodes; the original's from ``pinned`` (output → the input it
    replaces, the user's ``--state``), then names, then matching the original, then the fused pairing's
    output names. Outputs of SGD nodes are compared with the bound of
    this module, every other output must be identical in lockstep (NaN equal to NaN); in place, the value
    each side writes into each SGD-updated state must agree within the bound.

    ``node_tables``: ``(node_table(original), node_table(fused))`` (:func:`sgdfuse.passes.scan.node_table`), when
    the caller has read them (``sgdfuse check`` does, for the names' check); else they are read here.

    Raises:
        ValueError: the two models do not have the same graph inputs and outputs, or an input's shape is
            unknown so no test data can be made, or the original cannot run at any size.
    """
    original_initializers = {t.name for t in original.graph.initializer}  # once, not per input
    fused_initializers = {t.name for t in fused.graph.initializer}
    original_inputs = [i.name for i in original.graph.input if i.name not in original_initializers]
    fused_inputs = [i.name for i in fused.graph.input if i.name not in fused_initializers]
    outputs = [o.name for o in original.graph.output]
    if original_inputs != fused_inputs or outputs != [o.name for o in fused.graph.output]:
        raise ValueError("the two models differ in their graph inputs or outputs; they are not an original and its fused form")

    with collector.paused():  # millions of small containers, no cycles among them
        index = _declarations(original)
        tables = node_tables or (None, None)
        sides = (_Side.of(original, tables[0]), _Side.of(fused, tables[1]))
        views = _fused_views(sides[1], set(original_inputs))
        _probe_original_gradients(sides[0], views)
        _mark_upstream_gradients(views, [view.original_gradient for view in views], set(outputs))
        original_pairs = _original_pairs(index, original, views, pinned)
        for view in views:
            view.original_state = {s: original_pairs[s] for s in view.roles if s in original_pairs}
        fed_updates, readers_note = _feed_update_readers(sides, views, index)
        _mark_proven_upstream_gradients(sides, views, set(outputs))
        inputs = {spec.name: spec for spec in _check_inputs(index, original_inputs + fed_updates, views, sides[1])}
        fused_pairs = dict(original_pairs)
        for view in views:
            fused_pairs.update(view.fused_state)
        groups = _check_groups(sides, views, original_pairs, fused_pairs, inputs)

        output_tallies = {name: _Tally() for name in outputs}
        state_tallies = {(k, s): _Tally() for k, view in enumerate(views) for s in view.roles}
        memo: dict[str, frozenset] = {}
        isolable = _isolable_inputs(views, lambda view: sides[1].fed_sources(view.gradient, inputs, memo),
                                    set(original_pairs) | {s for view in views for s in view.roles})
        runner = _GroupRunner(index, sides, views, inputs, original_pairs, output_tallies, state_tallies, steps=steps, seed=seed,
                              isolable=isolable)
        runner.notes.extend(_claim_notes(index.graph_outputs, {s for view in views for s in view.roles}, original_pairs, pinned))
        if readers_note:
            runner.notes.append(readers_note)
        verified_as = _run_groups(index, sides, groups, views, inputs, original_pairs, fused_pairs, runner, seed=seed)
        _fail_inconsistent_overloads(fused, views, output_tallies, state_tallies, side=sides[1])
        if not runner.runs and not any(not t.passed for t in output_tallies.values()):
            raise ValueError("the original model cannot run at any size tried: " + "; ".join(runner.notes))

        update_outputs = {name for view in views for name in view.outputs}
        uncompared = _fail_uncompared(sides[1], views, inputs, output_tallies, state_tallies) if runner.runs else []
        listed = [
            {"name": name, "kind": "fused update" if name in update_outputs else "exact", "max_abs_error": t.max_abs,
             "max_bound_ratio": t.max_ratio, "passed": t.passed, "message": t.message, "verified_as": verified_as.get(name, "")}
            for name, t in output_tallies.items()
        ]
        in_place = [
            {"name": s, "kind": "in place", "original": views[k].original_state.get(s, s), "fused": views[k].fused_state.get(s, s),
             "max_abs_error": t.max_abs, "max_bound_ratio": t.max_ratio, "passed": t.passed, "message": t.message,
             "verified_as": verified_as.get((k, s), "")}
            for (k, s), t in state_tallies.items()
        ]
        passed = all(entry["passed"] for entry in listed + in_place)
        state_pairs = {o: s for s, o in original_pairs.items()}
        classes = f"; {len(groups)} independent groups of outputs, {runner.groups_run} run" + (
            ", the others verified as a run member of their class" if runner.groups_run < len(groups) else "")
        logger.info("check: %s", classes[2:])
        result = ModelCheck(steps, passed, listed, state_pairs, in_place, list(runner.runs), "; ".join(runner.notes), len(groups),
                            runner.groups_run, uncompared)
        # Free the check's own millions of objects while the collector is paused: once it runs again, its first
        # collection walks every object made meanwhile that is still alive (about a second at 50,000 updates).
        del index, sides, views, groups, runner, output_tallies, state_tallies, inputs, verified_as, fused_pairs, update_outputs
    return result


def _fail_uncompared(fused: "_Side", views: Sequence[_UpdateView], inputs: Mapping[str, _Input], output_tallies: dict,
                     state_tallies: dict, advice: str | None = None) -> list[str]:
    """After the runs of :func:`check_models` (or :func:`check_lowered`): fail what was never compared, an
    update's output NaN or infinite everywhere on every step, and the outputs and state writes of an update
    whose gradient was never live (:func:`_fail_dead_gradients`). Returns what was failed."""
    uncompared: list[str] = []
    for name in {name for view in views for name in view.outputs}:
        tally = output_tallies.get(name)
        if tally is not None and tally.passed and not tally.compared_finite:
            # NaN matches NaN: an output that is NaN (or infinite) everywhere on both sides was never compared.
            output_tallies[name] = copy.copy(tally)
            output_tallies[name].fail(
                f"{name}: the original gives no finite value on any step (NaN or infinite everywhere with the "
                "random inputs), so nothing was compared; the inputs the model reads may need values the random "
                "data does not have"
            )
            uncompared.append(name)
    uncompared.extend(_fail_dead_gradients(fused, views, inputs, output_tallies, state_tallies, advice))
    return uncompared


def check_lowered(
    model: onnx.ModelProto,
    fused_session,
    *,
    original_pairs: Mapping[str, str],
    written: Mapping[str, str],
    input_roles: Mapping[str, str] | None = None,
    loose=None,
    original_wrapper=None,
    exact_attributes: bool = False,
    steps: int = 3,
    seed: int = 0,
) -> ModelCheck:
    """:func:`check_models`'s comparison of a fused model (run in onnxruntime, the "original" side) with
    another implementation of it (the "fused" side: ``sgdfuse lower``'s GE graph in its executor), on one
    model that is not cut into groups: the same schedule (lockstep and in place, the extreme-value, restart,
    random-state and wide steps), natively and lifted to DOUBLE, the same bound for each SGD node's outputs and
    state writes, and the same failures for what was never compared (a gradient never live, an output NaN
    everywhere).

    The implementations may compute the values that are not an update's in another order (the executor's
    matrix products and reductions are not onnxruntime's): those outputs, and every SGD node's gradient
    (probed on both sides under one name), are compared with ``loose(name, original value) -> bound``
    (identical when None), and the bound of each update allows the measured difference of the gradients it
    read (|Δg|, :class:`_Terms`). So a gradient off by more than ``loose`` fails as a gradient, and what each
    update does with its gradient, state and coefficients is held to the bound of ``check``.

    Args:
        model: the fused ONNX model (fed graph inputs include every carried state; SGD nodes write into them).
        fused_session: ``fused_session(lifted: bool, views)`` → a session for :func:`sgdfuse.runtime.run` (a
            :class:`sgdfuse.runtime.ReferenceSession`) fed every input by ONNX name, state included, that
            returns the graph outputs, each SGD node's gradient, learning-rate and momentum operands under
            the names ``views[k].gradient``, ``.learning_rate``, ``.momentum`` (the update of SGD node ``k``
            writes its parameters into ``views[k].parameters``), and ``written[state]``: the value it holds
            in ``state`` after the step. With ``lifted`` it computes in DOUBLE.
        original_pairs: state input → the model's output that is its next value.
        written: state input → the name under which the fused session returns what it wrote into it.
        input_roles: fed input → its role, as :func:`_check_inputs` names them, plus "momentum" (a runtime
            momentum: fed as a coefficient, 0 on the second, zero-gradient, step), decided by the caller on a
            larger model (lower's: the whole fused model, of which ``model`` is a part); None: decided on
            ``model``. SGD-updated state is fed as state whatever its entry.
        loose: as above.
        original_wrapper: ``original_wrapper(session, lifted)`` → the session the original side runs
            (lower's: one that can also run a step's feeds nudged, for ``loose``), or None.
        exact_attributes: the caller has found every SGD op of the fused side to carry its node's dampening and
            weight decay bit for bit (lower's: the GE op's attributes against the fused node's), so the bound
            gives them no allowance. Either way the learning rate and momentum each op reads are compared with the
            original's (listed with kind "coefficient"): exactly where the fused model computes them by correctly
            rounded operations alone (:func:`_exactly_rounded`), then with no allowance in the bound either; with
            ``loose`` elsewhere (a schedule through ``Pow`` or ``Cos``), keeping the allowance of
            :data:`COEFFICIENT_ROUNDINGS` roundings.

    Raises:
        ValueError: an input's shape is unknown; an SGD node writes into a value that is not a graph input.
    """
    with collector.paused():
        initializers = {t.name for t in model.graph.initializer}
        names = [i.name for i in model.graph.input if i.name not in initializers]
        side = _Side.of(model)
        declared_outputs = list(side.outputs)
        views = _fused_views(side, set(names))
        # The coefficients are the fused node's own: lowering copies the attributes (the caller compares them,
        # ``exact_attributes``) and computes the learning rate and momentum from the same values. Where those are
        # computed by correctly rounded operations only (a constant, a fed value, a cast, a product of constants)
        # the two sides must give the same bits, and the probes are compared exactly; a GE constant one ulp off
        # was inside the allowance of COEFFICIENT_ROUNDINGS roundings, which stands for an exporter's folding.
        exact_probes: set[str] = set()
        for view in views:
            view.original_state = {s: original_pairs[s] for s in view.roles if s in original_pairs}
            view.fused_state = {s: written[s] for s in view.roles if s in written}
            view.original_gradient = view.gradient
            exact = {"d", "wd"} if exact_attributes else set()
            for tag, probe_name in (("lr", view.learning_rate), ("m", view.momentum)):
                if _exactly_rounded(side, probe_name):
                    exact.add(tag)
                    exact_probes.add(probe_name)
            view.exact_coefficients = frozenset(exact)
        index = _declarations(model)
        inputs = {spec.name: spec if input_roles is None or spec.role in ("parameters", "accum") or spec.name not in input_roles
                  else dataclasses.replace(spec, role=input_roles[spec.name]) for spec in _check_inputs(index, names, views, side)}
        gradients = list(dict.fromkeys(view.gradient for view in views))
        coefficients = [name for name in dict.fromkeys(v for view in views for v in (view.learning_rate, view.momentum))
                        if name not in declared_outputs and name not in gradients]
        outputs = list(dict.fromkeys(declared_outputs + gradients + coefficients))
        fused_names = list(dict.fromkeys(outputs + [v for view in views for v in (view.learning_rate, view.momentum)]
                                         + [v for view in views for v in view.fused_state.values()]))
        original, _ = _side_model(side, range(len(side.nodes)), outputs)
        try:
            inlined = specialise(original)
        except Exception as error:  # onnx's inliner refusing a model: run the functions as they are (slower)
            logger.info("could not inline the fused model's functions (%s); running it as it is", error)
            inlined = original
        update_outputs = {name for view in views for name in view.outputs}
        output_tallies = {name: _Tally(finite_alike=name in update_outputs) for name in outputs}
        state_tallies = {(k, s): _Tally(finite_alike=True) for k, view in enumerate(views) for s in view.roles}
        notes: list[str] = []
        runs: dict[str, None] = {}
        wrap = original_wrapper or (lambda session, lifted: session)
        pairs = [_Pair.of_sessions(wrap(make_session(inlined), False), fused_session(False, views), False)]
        try:
            # onnxruntime lacks DOUBLE kernels for some ops (Conv, Col2Im, LayerNormalization, ...): those nodes
            # run in onnx's reference implementation, so that the lifted run covers every part.
            lifted_session, referenced = make_session_with_reference_ops(lift_to_double(inlined))
            if referenced:
                logger.info("lifted run: %s computed by onnx's reference implementation (no DOUBLE kernel in onnxruntime)",
                            ", ".join(referenced))
            pairs.append(_Pair.of_sessions(wrap(lifted_session, True), fused_session(True, views), True))
        except Exception as error:  # onnxruntime's own exception types: no DOUBLE kernel, type errors
            ops = missing_kernels(error)
            reason = f"onnxruntime has no DOUBLE kernel for {', '.join(ops)}" if ops else str(error).strip().splitlines()[0]
            notes.append(f"the lifted (DOUBLE) comparison could not run ({reason}); checked in the native dtypes only")
        specs = list(inputs.values())
        numbered = list(enumerate(views))
        memo: dict[str, frozenset] = {}
        isolable = _isolable_inputs(views, lambda view: side.fed_sources(view.gradient, inputs, memo),
                                    set(original_pairs) | {s for view in views for s in view.roles})
        for pair in pairs:
            for position, size in enumerate(_sizes(specs)):
                label = _run_label(pair.label, size)
                if position:
                    # A fresh fused side per size: its state variables take their shapes from the run that
                    # initialises them (a GE Variable of [N, 4] is made at one N), as on the device.
                    pair = _Pair.of_sessions(pair.original, fused_session(pair.lifted, views), pair.lifted)
                try:
                    skipped = _check_schedule(pair, specs, numbered, outputs, fused_names, original_pairs, output_tallies,
                                              state_tallies, steps=steps, size=size, seed=seed, loose=loose, exact=exact_probes,
                                              isolating=_isolating_pair(pair, pairs), isolable=isolable)
                    if skipped and skipped not in notes:
                        notes.append(skipped)
                except _RunError as error:
                    if error.side == "original model":
                        notes.append(f"{label}: {error} (skipped)")
                        continue
                    for tally in list(output_tallies.values()) + list(state_tallies.values()):
                        tally.fail(f"{label}: {error}")
                    continue
                runs.setdefault(label)
        advice = ("the lowering check feeds every input random values and wide ones, and none reaches this gradient. "
                  "Lower a form of the step that takes the gradient as a graph input (it is then fed random values), "
                  "or pass --no-verify to write the graph unchecked")
        uncompared = _fail_uncompared(side, views, inputs, output_tallies, state_tallies, advice) if runs else []
        if not runs and all(t.passed for t in output_tallies.values()):
            raise ValueError("the fused model cannot run at any size tried: " + "; ".join(notes))
        update_outputs = {name for view in views for name in view.outputs}
        listed = [
            {"name": name, "kind": "fused update" if name in update_outputs else "gradient" if name in gradients and name not in declared_outputs
             else "coefficient" if name in coefficients else "exact", "max_abs_error": t.max_abs, "max_bound_ratio": t.max_ratio, "passed": t.passed, "message": t.message,
             "verified_as": ""}
            for name, t in output_tallies.items()
        ]
        in_place = [
            {"name": s, "kind": "in place", "original": views[k].original_state.get(s, s), "fused": views[k].fused_state.get(s, s),
             "max_abs_error": t.max_abs, "max_bound_ratio": t.max_ratio, "passed": t.passed, "message": t.message, "verified_as": ""}
            for (k, s), t in state_tallies.items()
        ]
        passed = all(entry["passed"] for entry in listed + in_place)
        return ModelCheck(steps, passed, listed, {o: s for s, o in original_pairs.items()}, in_place, list(runs), "; ".join(notes),
                          1, 1, uncompared)


CORRECTLY_ROUNDED_OPS = frozenset({
    "Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Expand", "Gather", "GatherElements", "Slice", "Concat",
    "Split", "Transpose", "Tile", "Cast", "CastLike", "Constant", "ConstantOfShape", "Shape", "Size", "Neg", "Abs",
    "Sign", "Add", "Sub", "Mul", "Div", "Sqrt", "Reciprocal", "Floor", "Ceil", "Round", "Min", "Max", "Clip", "Relu",
    "Where", "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor", "IsNaN", "IsInf",
})
"""ONNX operators (default domain) whose every result element is one correctly rounded IEEE operation of its
operands, or none (moves, comparisons, selections): two correct implementations give the same bits
(IEEE 754 section 5.4 for ``+ - * /`` and square root; FLOAT16 and BFLOAT16 computed in FLOAT and rounded
once give the correctly rounded result, see docs/design.md, "BFLOAT16 in onnxruntime"). Not ``Pow``, ``Exp``,
``Cos`` and the like (libraries differ in the last place), nor reductions and products (the order of the sum)."""


def _exactly_rounded(side: "_Side", value: str) -> bool:
    """Is ``value`` computed on ``side`` from fed inputs and constants by :data:`CORRECTLY_ROUNDED_OPS` alone
    (so that another correct implementation of the model gives it bit for bit)? A node with a subgraph, or of
    another domain, is not."""
    stack, seen = [value], set()
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        k = side.producer.get(name)
        if k is None:
            continue  # a fed input or an initializer
        if side.subgraph[k] or side.domains[k] not in ("", "ai.onnx") or side.op_types[k] not in CORRECTLY_ROUNDED_OPS:
            return False
        stack.extend(side.reads[k])
    return True


_CHECK_DEAD_ADVICE = (
    "check feeds every input random values and wide ones, and none reaches this gradient. Check a form of the "
    "step that takes the gradient as a graph input (it is then fed random values), or run sgdfuse optimize "
    "with its verification, which runs each update with its gradient fed"
)


def _fail_dead_gradients(fused: _Side, views: Sequence[_UpdateView], inputs: Mapping[str, _Input], output_tallies: dict,
                         state_tallies: dict, advice: str | None = None) -> list[str]:
    """Fail the outputs and state writes of every update whose gradient was never live on a compared step
    (:data:`WIDE`): its gradient term was never compared, so agreeing numbers say nothing about it. The message
    names the fed inputs the gradient is computed from, data before state (graph-input order). Returns what
    was failed (output names and state inputs)."""
    failed: list[str] = []
    memo: dict[str, frozenset] = {}
    order = {name: position for position, name in enumerate(inputs)}
    for k, view in enumerate(views):
        tallies = _view_tallies(k, view, output_tallies, state_tallies)
        if not tallies or any(t.gradient_seen for t in tallies):
            continue
        probe = fused.producer.get(view.gradient)
        gradient = fused.nodes[probe].input[0] if probe is not None else view.gradient
        found = fused.fed_sources(gradient, inputs, memo) - {gradient}
        sources = sorted(found, key=lambda name: (inputs[name].role in ("parameters", "accum"), order[name]))
        message = dead_gradient_message(gradient, sources, list(view.outputs), advice or _CHECK_DEAD_ADVICE)
        for name in view.outputs:
            if name in output_tallies and output_tallies[name].passed:
                output_tallies[name] = copy.copy(output_tallies[name])  # results may be shared within a class
                output_tallies[name].fail(message)
                failed.append(name)
        for state in view.roles:
            if state_tallies[(k, state)].passed:
                state_tallies[(k, state)] = copy.copy(state_tallies[(k, state)])
                state_tallies[(k, state)].fail(message)
                failed.append(state)
    return failed




def _function_key(function: onnx.FunctionProto) -> bytes:
    """A FunctionProto's bytes without its doc string (which says nothing about what it computes)."""
    copy_ = onnx.FunctionProto()
    copy_.CopyFrom(function)
    copy_.ClearField("doc_string")
    return copy_.SerializeToString(deterministic=True)


def _foreign_bodies(fused: onnx.ModelProto, overloads: set[str]) -> dict[str, str]:
    """overload → why the fused model's ``ai.sgdfuse::SGD`` function of that overload is not the contract's
    body (:func:`sgdfuse.fused_op.make_sgd_function` for the model's opset), for each overload the model's
    SGD nodes call whose function differs; empty when every body is the contract's.

    onnxruntime runs the model's own body, the device op computes the contract: a body edited by hand (a
    dampening written into it, a learning rate doubled inside while the node's input is halved) would make
    the two sides agree in onnxruntime and prove nothing about the device."""
    if not overloads:
        return {}
    present = {f.overload: f for f in fused.functions if f.domain == DOMAIN and f.name == OP_TYPE}
    try:
        contract = {f.overload: f for f in sgd_functions_for_overloads(overloads, function_opset(fused))}
    except ValueError as error:
        return {o: f"the SGD nodes call {o!r}, which has no contract body: {error}" for o in overloads}
    found: dict[str, str] = {}
    for overload in overloads:
        function = present.get(overload)
        if function is None:
            continue  # onnxruntime cannot run the model: check fails on its own
        if _function_key(function) != _function_key(contract[overload]):
            found[overload] = (
                f"the model's ai.sgdfuse::SGD function body{f' (overload {overload})' if overload else ''} is not the "
                "operator contract's: onnxruntime runs that body, the device's SGD op computes the contract, so "
                "their agreement here says nothing about the device. Re-run sgdfuse optimize on the original to "
                "write the contract's body."
            )
    return found


def _fail_inconsistent_overloads(fused: onnx.ModelProto, views: Sequence[_UpdateView], output_tallies, state_tallies,
                                 *, side: "_Side | None" = None) -> None:
    """Fail the outputs and state writes of every SGD node whose specialised body (its ``overload``, what
    onnxruntime runs) assumes other attributes than the node has (what the lowered GE op reads): the numbers
    of such a node prove nothing about the device. ``side``: the fused model's :class:`_Side` (its op types,
    domains and producers are then not read again)."""
    kinds = None
    if side is None:
        nodes = [node for node in fused.graph.node if node.domain == DOMAIN and node.op_type == OP_TYPE]
        constants = _ConstantInputs(fused.graph)
    else:
        positions = _sgd_positions(side)
        nodes = [side.nodes[k] for k in positions]
        constants = _ConstantInputs(fused.graph, _Producers(side))
        if side.table is not None and side.table.details is not None:
            # overload and attribute bytes from the node table (equal bytes, equal attributes)
            kinds = [side.table.details[k] for k in positions]
    if kinds is None:
        kinds = [(node.overload, tuple(a.SerializeToString(deterministic=True) for a in node.attribute)) for node in nodes]
    problems: dict[tuple, str] = {}  # per overload and attributes: a few hundred kinds of node at most
    bodies = _foreign_bodies(fused, {overload for overload, _ in kinds})
    for node, kind, (k, view) in zip(nodes, kinds, enumerate(views)):
        problem = problems.get(kind)
        if problem is None:
            problem = problems[kind] = _overload_problem(node)
        elif problem:
            problem = _overload_problem(node)  # the message names this node
        problem = problem or bodies.get(node.overload, "") or _overload_input_problem(node, constants)
        if not problem:
            continue
        for name in view.outputs:
            if name in output_tallies:
                output_tallies[name] = copy.copy(output_tallies[name])  # results may be shared within a class
                output_tallies[name].fail(problem)
        for state in view.roles:
            state_tallies[(k, state)] = copy.copy(state_tallies[(k, state)])
            state_tallies[(k, state)].fail(problem)


# ------------------------------------------------------------------------------ check_models: groups

CHECK_CHUNK_NODES = 400
"""About this many nodes (per side) go into one model that :func:`check_models` runs: groups are packed into
models of this size, so session building (faster than linear in the nodes of a model) stays linear overall."""

SHARED_CONE_LIMIT = 8
"""A node computed from at most this many nodes (counted with repetition, itself included) that reads no
carried state is copied into every group that needs it instead of joining them: a learning rate computed
once (``Neg → Reshape → Gather`` of a fed ``lr``) and read by every update does not make one group of them."""


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict = {}

    def find(self, item):
        parent = self.parent
        above = parent.get(item)
        while above is not None:  # path halving: every other item on the way points past its parent
            further = parent.get(above)
            if further is None:
                return above
            parent[item] = further
            item, above = further, parent.get(further)
        return item

    def union(self, a, b) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[ra] = rb


@dataclasses.dataclass
class _Side:
    """One model of :func:`check_models` as groups are cut from it: its nodes, what each reads and writes,
    producers, initializers, fed inputs and outputs."""

    model: onnx.ModelProto
    nodes: list[onnx.NodeProto]
    reads: list[list[str]]
    writes: list[list[str]]
    producer: dict[str, int]
    initializers: dict[str, onnx.TensorProto]
    inputs: dict[str, onnx.ValueInfoProto]
    outputs: list[str]
    subgraph: list[bool]
    """Per node: an attribute of it is of type ``GRAPH`` or ``GRAPHS``."""
    op_types: list[str] = dataclasses.field(default_factory=list)
    """Per node: ``NodeProto.op_type`` (read once, from the node table)."""
    domains: list[str] = dataclasses.field(default_factory=list)
    """Per node: ``NodeProto.domain``."""
    table: NodeTable | None = None
    """The node table of ``model``'s graph nodes (``len(table)`` of them; nodes added by :meth:`extend` come after)."""
    _opsets: list[onnx.OperatorSetIdProto] | None = dataclasses.field(default=None, repr=False)
    copies: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    """When every node after the table's is an ``Identity`` made here (:meth:`extend` with ``copies``): per node,
    ``(its input, its output)``; else empty."""
    rewired: set[int] = dataclasses.field(default_factory=set)
    """Positions of nodes replaced by a copy that reads other inputs (:func:`_feed_update_readers`): the table's
    inputs are not theirs."""

    @classmethod
    def of(cls, model: onnx.ModelProto, table: NodeTable | None = None) -> "_Side":
        """The side of ``model``; ``table``: its :func:`node_table`, when the caller has it."""
        graph = model.graph
        nodes = list(graph.node)
        initializers = {t.name: t for t in graph.initializer}
        # Inputs and outputs from the node table (read once from the serialised graph, no Python object per
        # field read); a node holding a subgraph also reads what its subgraphs read from outside.
        if table is None:
            table = node_table(model, details=True)
        if len(table) != len(nodes):
            raise ValueError(f"a node table of {len(table)} nodes for a graph of {len(nodes)}")
        reads = [
            _node_reads(node) if flagged else [name for name in names if name]
            for node, names, flagged in zip(nodes, table.inputs, table.has_subgraph)
        ]
        writes = [[o for o in names if o] for names in table.outputs]
        # The table's flag holds for every node with an attribute typed GRAPH or GRAPHS (and for one holding a
        # graph under another type): only those are read through protobuf.
        subgraph = [flagged and _holds_subgraph(node) for node, flagged in zip(nodes, table.has_subgraph)]
        return cls(
            model, nodes, reads, writes, {o: k for k, names in enumerate(writes) for o in names},
            initializers, {i.name: i for i in graph.input if i.name not in initializers}, [o.name for o in graph.output],
            subgraph, list(table.op_types), list(table.domains), table,
        )

    def sources(self, values: Iterable[str]) -> set[str]:
        """``values`` and every value they are computed from by this side's nodes."""
        found: set[str] = set()
        stack = list(values)
        producer, reads = self.producer.get, self.reads
        while stack:
            value = stack.pop()
            if value in found:
                continue
            found.add(value)
            k = producer(value)
            if k is not None:
                stack.extend(reads[k])
        return found

    def fed_sources(self, value: str, fed: Mapping[str, object], memo: dict[str, frozenset]) -> frozenset:
        """The names in ``fed`` that ``value`` is, or is computed from by this side's nodes. ``memo`` keeps the
        answer for every value visited, so that the cones of many values (the gradients of a chain of layers)
        are walked once between them."""
        stack = [value]
        visiting: set[str] = set()  # on the stack below: a cycle (a malformed model) is not followed round
        producer, reads = self.producer.get, self.reads
        empty: frozenset = frozenset()
        while stack:
            current = stack[-1]
            if current in memo:
                stack.pop()
                continue
            k = producer(current)
            if current not in visiting:
                visiting.add(current)
                pending = [name for name in reads[k] if name not in memo and name not in visiting] if k is not None else []
                if pending:
                    stack.extend(pending)
                    continue
            stack.pop()
            found = frozenset([current]) if current in fed else empty
            memo[current] = found.union(*(memo.get(name, empty) for name in reads[k])) if k is not None else found
        return memo[value]

    def extend(self, nodes: Sequence[onnx.NodeProto], outputs: Sequence[str], *,
               copies: Sequence[tuple[str, str]] | None = None) -> None:
        """Add ``nodes`` (after every other) and ``outputs`` (values to compute) to this side. ``copies``: when
        every node is an ``Identity`` made here (:class:`_Probes`), per node ``(its input, its output)``, which
        are then not read back from the nodes."""
        if copies is not None and len(self.nodes) == len(self.copies) + (len(self.table) if self.table is not None else -1):
            self.copies.extend(copies)
        elif nodes:
            self.copies = []  # other nodes after the table's: none is described from this list
        if copies is not None:
            producer, reads, writes = self.producer, self.reads, self.writes
            position = len(self.nodes)
            for node, (value, name) in zip(nodes, copies, strict=True):
                if name:
                    producer[name] = position
                position += 1
                reads.append([value] if value else [])
                writes.append([name] if name else [])
            self.nodes.extend(nodes)
            self.subgraph.extend([False] * len(nodes))
            self.op_types.extend(["Identity"] * len(nodes))
            self.domains.extend([""] * len(nodes))
            self.outputs.extend(outputs)
            return
        for node in nodes:
            self.producer.update((o, len(self.nodes)) for o in node.output if o)
            self.nodes.append(node)
            self.reads.append(_node_reads(node))
            self.writes.append([o for o in node.output if o])
            self.subgraph.append(_holds_subgraph(node))
            self.op_types.append(node.op_type)
            self.domains.append(node.domain)
        self.outputs.extend(outputs)

    def cone(self, outputs: Iterable[str]) -> list[int]:
        """Indices (in graph order) of the nodes that compute ``outputs``."""
        found: set[int] = set()
        producer, reads = self.producer, self.reads
        get = producer.get
        stack = [producer[o] for o in outputs if o in producer]
        push, pop, add = stack.append, stack.pop, found.add
        while stack:
            k = pop()
            if k in found:
                continue
            add(k)
            for name in reads[k]:
                j = get(name)
                if j is not None and j not in found:
                    push(j)
        return sorted(found)

    def parts(self, cone: Sequence[int], outputs: list[str], function_opset: int | None) -> _Parts:
        """The :class:`_Parts` of a model of the nodes ``cone`` with ``outputs``: its inputs are the fed
        graph inputs they read, its initializers the graph's they read."""
        reads, writes, nodes = self.reads, self.writes, self.nodes
        produced = {o for k in cone for o in writes[k]}
        initializers: list[onnx.TensorProto] = []
        inputs: list[str] = []
        graph_initializers, fed = self.initializers, self.inputs
        # Every name read (then the outputs) once, in the order of its first reading.
        for name in dict.fromkeys([n for k in cone for n in reads[k]] + outputs):
            if name in produced:
                continue
            if name in graph_initializers:
                initializers.append(graph_initializers[name])
            elif name in fed:
                inputs.append(name)
        if self._opsets is None:
            self._opsets = list(self.model.opset_import)
        return _Parts([nodes[k] for k in cone], [], outputs, list(self._opsets), function_opset, initializers, inputs)


@dataclasses.dataclass
class _Group:
    """Outputs of :func:`check_models` that are computed, compared and carried together and independently
    of every other group's: the original outputs, the fused model's (with its probes), the updates (indices
    of views) and the carried states among them; then the two slices and the group's canonical names."""

    original_outputs: list[str] = dataclasses.field(default_factory=list)
    fused_outputs: list[str] = dataclasses.field(default_factory=list)
    views: list[int] = dataclasses.field(default_factory=list)
    states: list[str] = dataclasses.field(default_factory=list)
    cones: tuple[list[int], list[int]] = ([], [])
    names: dict[str, int] = dataclasses.field(default_factory=dict)


_GRAPH_ATTRIBUTES = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)


def _holds_subgraph(node: onnx.NodeProto) -> bool:
    """An attribute of ``node`` is of type ``GRAPH`` or ``GRAPHS`` (``AttributeProto.type``)."""
    return any(a.type in _GRAPH_ATTRIBUTES for a in node.attribute)


def _shared_nodes(side: _Side, carried: set[str]) -> list[bool]:
    """Per node: is it copied into the groups that read it (:data:`SHARED_CONE_LIMIT`)? The nodes it is
    computed from are then copied too (their cones are smaller still)."""
    bound: list[int] = []
    over = SHARED_CONE_LIMIT + 1
    producer = side.producer.get
    for k, (reads, subgraph) in enumerate(zip(side.reads, side.subgraph)):
        if subgraph or not carried.isdisjoint(reads):
            bound.append(over)
            continue
        total = 1
        for name in reads:
            j = producer(name)
            if j is not None:
                total += bound[j] if j < k else over  # a producer listed later (unsorted graph): not copied
        bound.append(min(total, over))
    return [b <= SHARED_CONE_LIMIT for b in bound]


def _check_groups(sides: tuple[_Side, _Side], views: Sequence[_UpdateView], original_pairs: Mapping[str, str],
                  fused_pairs: Mapping[str, str], inputs: Mapping[str, _Input]) -> list[_Group]:
    """The outputs of both models partitioned into independent groups.

    Two outputs are in one group when a node that is not copied (:func:`_shared_nodes`) lies on both their
    cones in either model, when they belong to one update (its outputs, what it writes in place, its probes),
    or when one is the next value of a state that the other's cone reads (either side's pairing): so a group's
    nodes compute its outputs from fed inputs and its own carried state alone, and a model of one group, or of
    several, computes at every step what the whole model computes for them given the same feeds."""
    carried = set(original_pairs) | set(fused_pairs)
    # Union-find over integers, inlined: this visits every read of every node of both models. Nodes are
    # numbered across both sides; values get numbers after them, by name.
    parent = list(range(sum(len(side.nodes) for side in sides)))
    value_ids: dict[str, int] = {}

    def value(name: str) -> int:
        number = value_ids.get(name)
        if number is None:
            number = value_ids[name] = len(parent)
            parent.append(number)
        return number

    def find(item: int) -> int:
        while True:  # path halving
            above = parent[item]
            if above == item:
                return item
            further = parent[above]
            parent[item] = further
            if further == above:
                return above
            item = further

    def union(a: int, b: int) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[ra] = rb

    offset = 0
    for side in sides:
        shared = _shared_nodes(side, carried)
        outputs = set(side.outputs)
        producer = side.producer.get
        for k, (reads, writes) in enumerate(zip(side.reads, side.writes)):
            if shared[k]:
                continue
            # union(offset + k, x) for each x below, the reader's root found once and kept as the root of
            # what it joins (which root a union keeps does not change the partition).
            here = offset + k
            if parent[here] != here:
                here = find(here)
            for name in reads:
                j = producer(name)
                if j is not None and not shared[j]:
                    other = offset + j
                elif name in carried:
                    other = value(name)
                else:
                    continue
                above = parent[other]  # find(other), its two commonest cases inline: a root, a root's child
                if above != other:
                    other = above if parent[above] == above else find(above)
                if other != here:
                    parent[other] = here
            for name in writes:
                if name in outputs:
                    other = find(value(name))
                    if other != here:
                        parent[other] = here
        offset += len(side.nodes)
    for pairs in (original_pairs, fused_pairs):
        for state, output in pairs.items():
            union(value(state), value(output))
    for view in views:
        members = [*view.outputs, *view.fused_state.values(), *view.original_state.values(), *view.roles,
                   view.gradient, view.learning_rate, view.momentum, *([view.original_gradient] if view.original_gradient else [])]
        first = value(members[0])
        for name in members[1:]:
            union(first, value(name))
    groups: dict[int, _Group] = {}

    def group_of(name: str) -> _Group:  # groups.setdefault(find(value(name)), _Group()), no _Group made per call
        root = value_ids.get(name)
        if root is None:
            root = value(name)
        above = parent[root]
        if above != root:
            root = above if parent[above] == above else find(above)
        group = groups.get(root)
        if group is None:
            group = groups[root] = _Group()
        return group

    for name in sides[0].outputs:
        group_of(name).original_outputs.append(name)
    for name in sides[1].outputs:
        group_of(name).fused_outputs.append(name)
    for k, view in enumerate(views):
        group_of(view.parameters).views.append(k)
    for name in inputs:  # graph input order
        if name in carried:
            group_of(name).states.append(name)
    result = list(groups.values())
    for group in result:
        group.cones = (sides[0].cone(group.original_outputs), sides[1].cone(group.fused_outputs))
    return result


def _group_key(index: GraphIndex, sides: tuple[_Side, _Side], group: _Group, views: Sequence[_UpdateView],
               inputs: Mapping[str, _Input], original_pairs: Mapping[str, str], fused_pairs: Mapping[str, str],
               cache: dict | None = None) -> bytes | None:
    """A digest of ``group``'s two slices and of what is fed, compared and carried, every value name replaced
    by its order of first appearance (:func:`_describe_parts`, :func:`_describe_view`): groups with equal
    digests are equal up to one renaming of values. ``group.names`` is set to that renaming. None when a
    slice has a subgraph."""
    names: dict[str, int] = {}
    rename = _renamer(names)
    digest = hashlib.sha256()
    fed: list[str] = []
    for side, cone, outputs in zip(sides, group.cones, (group.original_outputs, group.fused_outputs)):
        parts = side.parts(cone, outputs, None)
        described = _describe_parts(parts, index.spec, names, cache)
        if described is None:
            return None
        fed.extend(parts.inputs)
        digest.update(_encoded(described))
    described = [
        [(rename(name), inputs[name].dtype, inputs[name].shape, inputs[name].role) for name in dict.fromkeys(fed)],
        [(rename(s), rename(original_pairs.get(s, "")), rename(fused_pairs.get(s, ""))) for s in group.states],
    ]
    described.extend(_describe_view(views[k], rename) for k in group.views)
    digest.update(_encoded(described))
    group.names = names
    return digest.digest()


class _GroupRunner:
    """Runs groups of :func:`check_models` packed into models of about :data:`CHECK_CHUNK_NODES` nodes,
    into the shared tallies."""

    def __init__(self, index, sides, views, inputs, original_pairs, output_tallies, state_tallies, *, steps: int, seed: int,
                 isolable: frozenset[str] = frozenset()) -> None:
        self.index, self.sides, self.views, self.inputs = index, sides, views, inputs
        self.isolable = isolable  # _isolable_inputs of the whole model
        self.original_pairs = original_pairs
        self.output_tallies, self.state_tallies = output_tallies, state_tallies
        self.steps, self.seed = steps, seed
        self.runs: dict[str, None] = {}
        self.notes: list[str] = []
        self.groups_run = 0
        self._chunks = 0
        self._pair_order: dict[str, int] | None = None
        self.referenced: set[str] = set()  # op types without a DOUBLE kernel met in a chunk so far (the next ones start with them)

    def run(self, groups: Sequence[_Group]) -> None:
        """Run ``groups``, packed into models of about :data:`CHECK_CHUNK_NODES` nodes."""
        chunk: list[_Group] = []
        size = 0
        for group in groups:
            if chunk and size + max(len(group.cones[0]), len(group.cones[1])) > CHECK_CHUNK_NODES:
                self._run_chunk(chunk)
                chunk, size = [], 0
            chunk.append(group)
            size += max(len(group.cones[0]), len(group.cones[1]))
        if chunk:
            self._run_chunk(chunk)

    def _model(self, tag: int, chunk: Sequence[_Group]) -> tuple[onnx.ModelProto, list[str]]:
        cone = sorted(set().union(*(group.cones[tag] for group in chunk)))
        outputs = [name for group in chunk for name in (group.original_outputs if tag == 0 else group.fused_outputs)]
        return _side_model(self.sides[tag], cone, outputs)

    def _run_chunk(self, chunk: Sequence[_Group]) -> None:
        self.groups_run += len(chunk)
        self._chunks += 1
        (original, original_fed), (fused, fused_fed) = self._model(0, chunk), self._model(1, chunk)
        views = [(k, self.views[k]) for group in chunk for k in group.views]
        states = {s for group in chunk for s in group.states}
        # The chunk's pairs in the order of the whole model's (not a pass over all of them per chunk).
        order = self._pair_order
        if order is None:
            order = self._pair_order = {s: position for position, s in enumerate(self.original_pairs)}
        original_pairs = {s: self.original_pairs[s] for s in sorted((s for s in states if s in order), key=order.__getitem__)}
        inputs = [self.inputs[name] for name in dict.fromkeys(original_fed + fused_fed)]
        outputs = [name for group in chunk for name in group.original_outputs]
        fused_names = [name for group in chunk for name in group.fused_outputs]
        pairs, note, _ = _make_pairs(original, fused, known=self.referenced)
        if note and note not in self.notes:
            self.notes.append(note)
        for pair in pairs:
            self.referenced.update(pair.referenced)
        seed = self.seed + self._chunks - 1
        for pair in pairs:
            for size in _sizes(inputs):
                label = _run_label(pair.label, size)
                try:
                    skipped = _check_schedule(pair, inputs, views, outputs, fused_names, original_pairs, self.output_tallies,
                                              self.state_tallies, steps=self.steps, size=size, seed=seed,
                                              isolating=_isolating_pair(pair, pairs), isolable=self.isolable)
                    if skipped and skipped not in self.notes:
                        self.notes.append(skipped)
                except _RunError as error:
                    if error.original:
                        text = f"{label}: {error} (skipped)"
                        if text not in self.notes:
                            self.notes.append(text)
                        continue
                    for name in outputs:
                        if name in self.output_tallies:  # not a probe
                            self.output_tallies[name].fail(f"{label}: {error}")
                    for k, view in views:
                        for state in view.roles:
                            self.state_tallies[(k, state)].fail(f"{label}: {error}")
                    continue
                self.runs.setdefault(label)


def _side_model(side: _Side, cone: Sequence[int], outputs: list[str]) -> tuple[onnx.ModelProto, list[str]]:
    """A model of ``side``'s nodes ``cone`` (graph order) computing ``outputs``, with the graph's opsets,
    IR version and functions; and its fed inputs."""
    parts = side.parts(cone, outputs, None)
    graph = helper.make_graph(
        parts.nodes, "sgdfuse_part", [side.inputs[name] for name in parts.inputs],
        [helper.make_empty_tensor_value_info(name) for name in outputs], initializer=parts.needed_initializers,
    )
    model = helper.make_model(graph, opset_imports=parts.opset_import)
    model.ir_version = side.model.ir_version
    model.functions.extend(side.model.functions)
    return model, parts.inputs


def independent_models(model: onnx.ModelProto, *, max_nodes: int = CHECK_CHUNK_NODES) -> list[onnx.ModelProto]:
    """``model`` cut into models of about ``max_nodes`` nodes each (more for one group that is larger) that
    together compute every graph output of ``model`` once, each from the graph inputs it reads.

    Outputs are grouped as :func:`check_models` groups them (outputs whose cones share a node that is not
    copied, :data:`SHARED_CONE_LIMIT`, are in one model; small shared nodes are copied into each model that
    reads them), so that onnxruntime, whose session building grows faster than linearly with the nodes of a
    model, builds several small sessions in linear time. Every model computes its outputs with the nodes
    ``model`` computes them with, in the same order: for the same feeds, the same numbers.

    Args:
        model: an ONNX model whose nodes are in graph (topological) order.
        max_nodes: nodes per model, about.
    """
    parts = ModelParts(model)  # no carried state: the groups are those of the outputs' cones alone
    models: list[onnx.ModelProto] = []
    cone: set[int] = set()
    chunk: list[str] = []
    for names, _ in parts.groups:
        own = parts.cone(names)
        if chunk and len(cone) + len(own) > max_nodes:
            models.append(parts.model(chunk))
            cone, chunk = set(), []
        cone.update(own)
        chunk.extend(names)
    if chunk or not models:
        models.append(parts.model(chunk))
    return models


class ModelParts:
    """``model``'s graph outputs cut into independent groups, as :func:`check_models` cuts them, with the
    state carried between steps kept together: two outputs are in one group when a node that is not copied
    (:data:`SHARED_CONE_LIMIT`) lies on both their cones, or when one is the next value of a state (a graph
    input) that the other's cone reads. So the nodes of a group compute its outputs from fed inputs and the
    group's own carried state alone, with exactly the nodes ``model`` computes them with.

    Attributes:
        groups: per group, ``(its graph outputs in graph order, its carried states in graph-input order)``.

    Args:
        model: an ONNX model whose nodes are in graph (topological) order (never mutated; it must outlive
            this object, which holds its nodes).
        pairs: carried state (a graph input) → the graph output that is its next value.
    """

    def __init__(self, model: onnx.ModelProto, *, pairs: Mapping[str, str] | None = None) -> None:
        pairs = dict(pairs or {})
        side = self._side = _Side.of(model)
        carried = set(pairs)
        shared = _shared_nodes(side, carried)
        uf = _UnionFind()
        outputs = set(side.outputs)
        for k, node in enumerate(side.nodes):
            if shared[k]:
                continue
            for name in side.reads[k]:
                j = side.producer.get(name)
                if j is not None and not shared[j]:
                    uf.union(k, j)
                elif name in carried:
                    uf.union(k, name)
            for name in node.output:
                if name in outputs:
                    uf.union(k, name)
        for state, output in pairs.items():
            uf.union(state, output)
        found: dict[object, tuple[list[str], list[str]]] = {}
        for name in side.outputs:
            found.setdefault(uf.find(name), ([], []))[0].append(name)
        for name in side.inputs:
            if name in carried:
                found.setdefault(uf.find(name), ([], []))[1].append(name)
        self.groups: list[tuple[list[str], list[str]]] = list(found.values())

    def cone(self, outputs: Iterable[str]) -> list[int]:
        """Positions (graph order) of the nodes that compute ``outputs``."""
        return self._side.cone(outputs)

    def model(self, outputs: list[str]) -> onnx.ModelProto:
        """A model of the nodes computing ``outputs`` (graph order), fed the graph inputs they read, with the
        graph's initializers they read, opsets, IR version and functions."""
        return _side_model(self._side, self._side.cone(outputs), outputs)[0]

    def inputs(self, outputs: list[str]) -> list[str]:
        """The fed graph inputs the nodes computing ``outputs`` read (or that are among ``outputs``), in the
        order of first reading."""
        return self._side.parts(self._side.cone(outputs), outputs, None).inputs

    def describe(self, outputs: list[str], spec_of, names: dict[str, int], cache: dict | None = None) -> list | None:
        """What the model of ``outputs`` computes, every value name replaced by its number in ``names`` (its
        order of first appearance; ``names`` is filled): opsets, fed inputs with ``spec_of(name).dtype`` and
        ``.shape``, initializers by value, each node's operator, domain, overload, attributes and renamed
        inputs and outputs, the outputs (the description :func:`check_models` keys its classes of groups by).
        None when a node holds a subgraph. ``cache``: as for :func:`check_models` (the model outlives it)."""
        return _describe_parts(self._side.parts(self._side.cone(outputs), outputs, None), spec_of, names, cache)


def _describe_plain_nodes(side: _Side, cache: dict) -> None:
    """Put into ``cache`` (:func:`_describe_parts`' own, keyed by node id: ``side`` must outlive it) the description
    of each of ``side``'s graph nodes that holds no subgraph, from its node table: ``(op_type, domain, overload,
    the attributes' bytes, the number of inputs)`` interned, and its inputs, ``""`` and outputs, exactly what :func:`_describe_parts`
    would read of the node. Only ``overload`` and the attributes are read from the node. A node the table flags
    as holding a subgraph (an attribute typed ``GRAPH`` or ``GRAPHS``, or one holding a graph) is left to
    :func:`_describe_parts`, which decides on it as before."""
    table = side.table
    if table is None:
        return
    intern = cache.setdefault("interned", {})
    setdefault = intern.setdefault
    nodes = side.nodes
    if side.copies:  # the probes :meth:`_Side.extend` added: Identity(value) -> name, made by helper.make_node
        copy_what = setdefault(("Identity", "", "", (), 1), len(intern))
        for node, (value, name) in zip(nodes[len(table):], side.copies, strict=True):
            cache[id(node)] = (copy_what, (value, "", name))
    if table.details is not None:
        # The table's own overloads and attribute bytes (as they stand in the file: equal bytes are equal
        # attributes, so equal descriptions still mean equal nodes), with no protobuf object made per node.
        for node, op_type, domain, inputs, outputs, subgraph, (overload, attributes) in zip(
                nodes, table.op_types, table.domains, table.inputs, table.outputs, table.has_subgraph, table.details):
            if not subgraph:
                cache[id(node)] = (setdefault((op_type, domain, overload, attributes, len(inputs)), len(intern)), (*inputs, "", *outputs))
        for k in side.rewired:  # described from the node itself, which reads other inputs than the table says
            cache.pop(id(nodes[k]), None)
        return
    serialise = functools.partial(onnx.AttributeProto.SerializeToString, deterministic=True)
    for node, op_type, domain, inputs, outputs, attributed, subgraph in zip(
            nodes, table.op_types, table.domains, table.inputs, table.outputs, table.has_attributes, table.has_subgraph):
        if subgraph:
            continue
        what = (op_type, domain, node.overload, tuple(map(serialise, node.attribute)) if attributed else (), len(inputs))
        cache[id(node)] = (setdefault(what, len(intern)), (*inputs, "", *outputs))
    for k in side.rewired:
        cache.pop(id(nodes[k]), None)


def _run_groups(index, sides, groups: Sequence[_Group], views, inputs, original_pairs, fused_pairs, runner: _GroupRunner, *, seed: int) -> dict:
    """Run every group, or from :data:`CLASS_MIN_PLANS` groups on, per class of groups equal up to value
    names (:func:`_group_key`) its first member and a seeded sample of :data:`CLASS_SAMPLE` others; a class
    whose run members all passed gives every other member their results (returned: output name or (view
    index, state) → the representative's), a class with a failure has every member run."""
    if len(groups) < CLASS_MIN_PLANS:
        runner.run(groups)
        return {}
    classes: dict[object, list[int]] = {}
    cache: dict = {}  # the sides' protos outlive it
    for side in sides:
        _describe_plain_nodes(side, cache)
    for g, group in enumerate(groups):
        key = _group_key(index, sides, group, views, inputs, original_pairs, fused_pairs, cache)
        classes.setdefault(("own", g) if key is None else key, []).append(g)
    sampler = random.Random(seed)
    chosen: set[int] = set()
    for members in classes.values():
        chosen.add(members[0])
        chosen.update(sampler.sample(members[1:], min(CLASS_SAMPLE, len(members) - 1)))
    runner.run([groups[g] for g in sorted(chosen)])
    logger.info("check: %d groups in %d classes, %d run", len(groups), len(classes), len(chosen))
    verified_as: dict = {}
    unrun: list[int] = []
    for members in classes.values():
        ran = [groups[g] for g in members if g in chosen]
        if all(_group_passed(group, runner) for group in ran):
            first = groups[members[0]]
            by_name = {canonical: name for name, canonical in first.names.items()}  # once per class
            for g in members:
                if g not in chosen:
                    _copy_results(first, groups[g], runner, verified_as, by_name)
        else:
            unrun.extend(g for g in members if g not in chosen)
    runner.run([groups[g] for g in sorted(unrun)])
    return verified_as


def _group_passed(group: _Group, runner: _GroupRunner) -> bool:
    # Only graph outputs have tallies (an original's gradient probe has none).
    return all(runner.output_tallies[name].passed for name in group.original_outputs if name in runner.output_tallies) and all(
        runner.state_tallies[(k, s)].passed for k in group.views for s in runner.views[k].roles
    )


def _copy_results(first: _Group, member: _Group, runner: _GroupRunner, verified_as: dict,
                  by_name: Mapping[int, str] | None = None) -> None:
    """``member`` gets ``first``'s results, value for value through the two groups' canonical names.
    ``by_name``: ``first``'s canonical number → name (its ``names`` inverted), when the caller keeps it."""
    if by_name is None:
        by_name = {canonical: name for name, canonical in first.names.items()}
    names, output_tallies, state_tallies, views = member.names, runner.output_tallies, runner.state_tallies, runner.views
    for name in member.original_outputs:
        if name not in output_tallies:
            continue  # a probe (the original's gradient): no result of its own
        source = by_name[names[name]]
        output_tallies[name] = output_tallies[source]
        verified_as[name] = source
    for k, j in zip(member.views, first.views):
        for state in views[k].roles:
            source = by_name[names[state]]
            state_tallies[(k, state)] = state_tallies[(j, source)]
            verified_as[(k, state)] = source


class _Producers(Mapping):
    """value name → the node of ``side`` that outputs it (a view of ``side.producer``, no table built)."""

    def __init__(self, side: _Side) -> None:
        self.side = side

    def __getitem__(self, name: str) -> onnx.NodeProto:
        return self.side.nodes[self.side.producer[name]]

    def __contains__(self, name: object) -> bool:
        return name in self.side.producer

    def __iter__(self):
        return iter(self.side.producer)

    def __len__(self) -> int:
        return len(self.side.producer)


def _sgd_positions(side: _Side) -> list[int]:
    """Positions of ``side``'s ``ai.sgdfuse::SGD`` nodes, in graph order (from its op types and domains)."""
    return [k for k, (op_type, domain) in enumerate(zip(side.op_types, side.domains)) if op_type == OP_TYPE and domain == DOMAIN]


def _fused_views(side: _Side, graph_inputs: set[str]) -> list[_UpdateView]:
    """One view per SGD node of the fused model's ``side``, which gets the probes of the SGD nodes' inputs
    as nodes and outputs, and their outputs that the graph does not declare (the model is not copied)."""
    graph = side.model.graph
    producers = _Producers(side)
    # Readers of the SGD nodes' outputs and of what their readers output (a runtime momentum's If, a guard)
    # are all that is looked up: two sweeps, no table of every value's readers.
    sgd = _sgd_positions(side)
    writes = side.writes  # each node's outputs but ""
    wanted = {o for k in sgd for o in writes[k]}
    # (The set grows as the generator runs, as it always did: a reader of a reader found earlier is found too.)
    wanted.update(o for k, reads in enumerate(side.reads) if not wanted.isdisjoint(reads) for o in writes[k])
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node, reads in zip(side.nodes, side.reads):
        for name in reads:
            if name in wanted:
                readers.setdefault(name, []).append(node)
    # Every name defined: node outputs, graph inputs (the fed ones and those that are initializers too), initializers.
    taken = set(side.producer) | set(side.inputs) | set(side.initializers)
    declared = set(side.outputs)
    fed = side.inputs  # the graph inputs that are no initializer, by name (the last of a name, as below)

    def input_type(name: str) -> int:
        # What {i.name: i.type.tensor_type.elem_type for i in graph.input}.get(name, FLOAT) gives, without
        # reading every input's type: the parameters are fed inputs (checked below), so the last of the name.
        info = fed.get(name)
        if info is None:
            info = next((i for i in reversed(graph.input) if i.name == name), None)
        return info.type.tensor_type.elem_type if info is not None else onnx.TensorProto.FLOAT
    # One probe per SGD node, not per value: a probe read by every update would make one group of them all.
    probe = _Probes(taken, shared=False)
    views: list[_UpdateView] = []
    added: list[str] = []
    details = side.table.details if side.table is not None else None
    attributes_of: dict[tuple, SgdAttributes] = {}  # per attributes' bytes (equal bytes, equal attributes)
    for k in sgd:
        node = side.nodes[k]
        parameters = _trace_to_state(node.input[0], producers)
        accum = _trace_to_state(node.input[3], producers)
        for role, target in (("parameters", parameters), ("accum", accum)):
            if target not in graph_inputs:
                raise ValueError(
                    f"SGD node {node.name or '(unnamed)'} writes its {role} in place into {target}, which is not a graph "
                    "input: the fused model cannot be run with its state fed back"
                )
        buffer_out = _forward_buffer(node.output[1], readers.get(node.output[1], []))
        parameters_out = _through_guard(node.output[0], parameters, readers.get(node.output[0], []), producers.get)
        buffer_out = _through_guard(buffer_out, accum, readers.get(buffer_out, []), producers.get)
        if details is None:
            attributes = read_sgd_attributes(node)
        else:
            attributes = attributes_of.get(details[k][1])
            if attributes is None:
                attributes = attributes_of[details[k][1]] = read_sgd_attributes(node)
        for value in (parameters_out, buffer_out):
            if value not in declared:
                added.append(value)
                declared.add(value)
        names = {tag: probe(node.input[k], tag) for k, tag in ((1, "gradient"), (2, "learning_rate"), (4, "momentum"))}
        dtype = input_type(parameters)
        views.append(
            _UpdateView(
                key=node.output[0], outputs={parameters_out: "w", buffer_out: "v"}, original_state={},
                fused_state={parameters: parameters_out, accum: buffer_out}, roles={parameters: "w", accum: "v"},
                parameters=parameters, accum=accum, gradient=names["gradient"], gradient_side="fused", gradient_operand=node.input[1],
                learning_rate=names["learning_rate"], momentum=names["momentum"], dampening=attributes.dampening,
                weight_decay=attributes.weight_decay, nesterov=attributes.nesterov,
                dtype=dtype if dtype in _UNIT_ROUNDOFF else onnx.TensorProto.FLOAT,
            )
        )
    side.extend(probe.nodes, added + [name for _, name in probe.copies], copies=probe.copies)
    return views


UPDATE_FEED_PREFIX = "sgdfuse_check/update/"
"""Prefix of the inputs :func:`_feed_update_readers` gives the readers of an update's output."""


def _feed_update_readers(sides: tuple[_Side, _Side], views: Sequence[_UpdateView], index: GraphIndex) -> tuple[list[str], str]:
    """Make what reads an update's output from outside the update (a logged norm ``ReduceSumSquare(w_out)``)
    read a fed input instead, on both sides alike; returns the new inputs' names and a note naming the outputs
    so checked, and the readers that reach no output ("" when none).

    Such an output is computed from the new weights, which the two models compute within the update's bound,
    not identically: compared exactly, it disagreed by the update's own rounding (a norm of 64 x 32 weights by
    2.4e-4 of 2165). Fed one value on both sides, the nodes after the update must give identical numbers,
    which proves them unchanged, while the update's outputs are compared within their bound as before. The
    same holds where those nodes compute the gradient of a later update (a chain ``g2 = 2*w1_new`` whose SGD
    node reads ``mul_3 = 2*add_1``) or the values an unfused update computes before a fused one reads them
    (``g3 = 2*w2_new`` with the second update left unfused): fed one value, the two gradients are equal
    unless a node between differs, and the later update is compared within its bound with no allowance for
    a gradient difference in lockstep, so a kept ``mul_3`` edited to ``2.000001*add_1`` fails there; the
    unfused update's outputs must be identical. Compared from each side's own ``add_1`` instead, they differed
    by the first update's rounding, which no bound allowed (check failed correct fusions of chains at
    dampening 0.9, tests/test_check_chained_updates.py).

    A reader is found on the fused side: a node that reads a graph output of an update (:attr:`_UpdateView.outputs`)
    and is not part of an update (no ``SGD`` node, none of its outputs an update's value, and no probe of what an
    SGD node reads: the probe of a chained update's gradient ``add_1``, the new weights of the update before it
    (``g2 = 2*w1_new`` fused as ``SGD(p1, w1_new, ...)``), must read what that SGD node reads, or the bound
    takes its gradient from the fed value, 0 on the zero-gradient step, instead of ``w1_new``). A reader from
    which no graph output and no state write of the fused model is computed (the ``mul_11 = 2*w3_new`` after
    the last update of a chain) is left alone and named in the note as checked by nothing. In the original the
    node that writes the same first output is rewired too, for the inputs it reads by those names, unless it
    is part of an update's own computation there: an update's value is computed from it that the fused model
    does not compute from its reader (the original's ``delta = lr*buf_out`` is both a graph output and the
    step ``p_out`` subtracts, which the fused SGD node computes itself: then neither is rewired; a chain's
    ``mul_3 = 2*add_1`` is the next update's gradient on both sides, and is rewired). A reader the original
    has no node for (a helper of the rewrite, ``Neg(buf_out)`` as the next update's gradient) is not rewired either: what it computes is compared where it is read, with
    no allowance in lockstep (a fed value on the fused side alone made the next update read other numbers than
    the original's, a false failure by a factor of 1e10). A fused model whose node reads something else than
    the original's computes from another value than the original, and fails.
    Each rewired node is a copy (the model is not modified), its position in :attr:`_Side.rewired`."""
    fused = sides[1]
    members = {name for view in views for name in (*view.outputs, *view.fused_state.values(), *view.original_state.values())}
    probes = {name for view in views for name in (view.gradient, view.learning_rate, view.momentum)}
    outputs = set(fused.outputs)
    updated = {name for view in views for name in view.outputs if name in outputs}
    if not updated:
        return [], ""
    found: list[tuple[int, list[str]]] = []  # fused readers, with the update outputs each reads
    for k, reads in enumerate(fused.reads):
        if updated.isdisjoint(reads):
            continue
        if fused.op_types[k] == OP_TYPE and fused.domains[k] == DOMAIN or not members.isdisjoint(fused.writes[k]):
            continue
        if not probes.isdisjoint(fused.writes[k]):
            continue  # a probe of an SGD node's operand: it reads what the SGD node reads
        found.append((k, [name for name in reads if name in updated]))
    if not found:
        return [], ""
    live_set = set(fused.cone([o.name for o in fused.model.graph.output] + [o for view in views for o in view.fused_state.values()]))
    dead = [fused.writes[k][0] if fused.writes[k] else fused.nodes[k].name for k, _ in found if k not in live_set]
    found = [(k, names) for k, names in found if k in live_set]
    original = sides[0]
    original_reach, fused_reach = (_UpdateValuesReached(side, members) for side in sides)
    fed: dict[str, str] = {}
    rewired_outputs: list[str] = []
    for k, names in found:
        first = fused.writes[k][0] if fused.writes[k] else ""
        j = original.producer.get(first) if first else None
        # The original's node j is part of an update's own computation when an update's value is computed
        # from it there that the fused model does not compute from its reader k (the original's delta =
        # lr*buf_out is both a graph output and the step p_out subtracts, which the fused SGD node computes
        # itself; a chain's mul_3 = 2*add_1 is the next update's gradient on both sides).
        if j is None or not original_reach(j) <= fused_reach(k):
            continue  # compared as before: no node of the original computes it, or one inside an update does
        for side, position in ((fused, k), (original, j)):
            node = side.nodes[position]
            if not any(name in names for name in side.reads[position]):
                continue
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            for name in names:
                fed.setdefault(name, UPDATE_FEED_PREFIX + name)
            _rename_reads(copy, {name: fed[name] for name in names})
            side.nodes[position] = copy
            side.reads[position] = [fed.get(name, name) for name in side.reads[position]]
            side.rewired.add(position)
        rewired_outputs.append(first)
    for name, input_name in fed.items():
        spec = index.spec(name)
        index.specs[input_name] = TensorSpec(input_name, spec.shape, spec.dtype)
        info = helper.make_tensor_value_info(input_name, spec.dtype, spec.shape) if spec.shape is not None else onnx.ValueInfoProto(name=input_name)
        for side in sides:
            side.inputs[input_name] = info
    return list(fed.values()), _readers_note(rewired_outputs, dead)


class _UpdateValuesReached:
    """The update values (``members``) computed from a node of ``side``, up to the first on each path (past an
    update's value, what is computed is another reader's); the readers of each value are tabled on first use."""

    def __init__(self, side: _Side, members: set[str]) -> None:
        self.side = side
        self.members = members
        self._readers: dict[str, list[int]] | None = None

    def __call__(self, start: int) -> set[str]:
        if self._readers is None:
            self._readers = {}
            for j, reads in enumerate(self.side.reads):
                for name in reads:
                    self._readers.setdefault(name, []).append(j)
        reached: set[str] = set()
        stack, seen = [start], {start}
        while stack:
            for name in self.side.writes[stack.pop()]:
                if name in self.members:
                    reached.add(name)
                    continue
                for reader in self._readers.get(name, ()):
                    if reader not in seen:
                        seen.add(reader)
                        stack.append(reader)
        return reached


def _readers_note(rewired: Sequence[str], dead: Sequence[str]) -> str:
    """The note of :func:`_feed_update_readers`: the readers fed a value (by their first outputs) and those
    no output is computed from ("" when neither)."""
    def shown(names: Sequence[str]) -> str:
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    notes = []
    if rewired:
        notes.append(f"{shown(rewired)} read the new value of an update (the models compute it within the update's "
                     "bound, not identically): checked from the same fed value of it on both sides, which must give "
                     "identical numbers (or, where they are a fused update's gradient, that update's outputs within its bound)")
    if dead:
        notes.append(f"{shown(dead)} read the new value of an update but no output of the model is computed from "
                     f"{'them' if len(dead) > 1 else 'it'}: not checked")
    return "; ".join(notes)


_STANDARD_DOMAINS = frozenset({"", "ai.onnx"})


def _mark_proven_upstream_gradients(sides: tuple[_Side, _Side], views: Sequence[_UpdateView], compared: set[str]) -> None:
    """``check``: set :attr:`_UpdateView.upstream_gradient` of each view whose SGD node's gradient is computed,
    on the fused side, from another update's output by nodes proven to be the original's own, where
    :func:`_feed_update_readers` could not feed those nodes a value (the original computes its update from
    them: ``mul_3 = 2*mul_2`` where ``mul_2 = lr*buf_out`` is also the step of the update before).

    Why the measured difference is sound then, and not otherwise: the two sides' gradients differ by what
    the nodes between make of the difference of the upstream outputs, each compared within its own update's
    bound (``compared``: graph outputs only). A node between that the fused model changed (``mul_3 =
    2.000001*mul_2`` on the fused side alone) would add its own error to that difference, and a measured
    difference would absorb it: so every value the gradient is computed from must be, on both sides, a fed
    input, an initializer of the same name, dtype, shape and value, another update's compared output, or the
    output of a node of the same standard op (no subgraph, no model function, the same opset version), the
    same inputs and outputs by name and the same attributes, itself proven so. A gradient that is not proven
    keeps no allowance in lockstep (a false failure at worst). A gradient read as a plain ``Neg`` of another
    update's compared output gets :attr:`_UpdateView.negated_upstream` instead (no proof needed: its
    counterpart is computed from the original's own run)."""
    original, fused = sides
    owner = {name: k for k, view in enumerate(views) for name in view.outputs if name in compared}
    reaches: dict[str, bool] = {}

    def reach(value: str) -> bool:
        # Whether value is computed, on the fused side, from an update's compared output (memoised).
        stack, visiting = [value], set()  # visiting: on the stack, a cycle (a malformed model) is not followed round
        while stack:
            current = stack[-1]
            if current in reaches:
                stack.pop()
                continue
            k = fused.producer.get(current)
            if current in owner or k is None:
                reaches[current] = current in owner
                stack.pop()
                continue
            if current not in visiting:
                visiting.add(current)
                pending = [name for name in fused.reads[k] if name not in reaches and name not in visiting]
                if pending:
                    stack.extend(pending)
                    continue
            stack.pop()
            reaches[current] = any(reaches.get(name, False) for name in fused.reads[k])
        return reaches[value]

    def opsets(model: onnx.ModelProto) -> dict[str, int]:
        return {("" if o.domain == "ai.onnx" else o.domain): o.version for o in model.opset_import}

    original_opsets, fused_opsets = opsets(original.model), opsets(fused.model)
    functions = {(f.domain, f.name) for side in sides for f in side.model.functions}
    proven: dict[str, bool] = {}

    def same_node(name: str) -> tuple[bool, list[str]]:
        k, j = fused.producer.get(name), original.producer.get(name)
        if k is None or j is None or fused.subgraph[k] or original.subgraph[j]:
            return False, []
        a, b = fused.nodes[k], original.nodes[j]
        if (a.domain not in _STANDARD_DOMAINS or b.domain not in _STANDARD_DOMAINS or (a.domain, a.op_type) in functions
                or (b.domain, b.op_type) in functions or a.op_type != b.op_type or a.overload or b.overload
                or list(a.input) != list(b.input) or list(a.output) != list(b.output)
                or original_opsets.get("") != fused_opsets.get("")):
            return False, []
        attributes = [sorted(x.SerializeToString() for x in node.attribute) for node in (a, b)]
        return attributes[0] == attributes[1], [n for n in a.input if n]

    def same_leaf(name: str) -> bool:
        if name in owner or (name in fused.inputs and name in original.inputs):
            return True
        a, b = fused.initializers.get(name), original.initializers.get(name)
        if a is None or b is None or name in original.producer:
            return False
        x, y = numpy_helper.to_array(a), numpy_helper.to_array(b)
        return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()

    def prove(value: str) -> bool:
        stack, order = [value], []
        seen = {value}
        while stack:
            current = stack.pop()
            if current in proven:
                if not proven[current]:
                    return False
                continue
            if current in owner or current not in fused.producer:
                proven[current] = same_leaf(current)
                if not proven[current]:
                    return False
                continue
            ok, reads = same_node(current)
            if not ok:
                proven[current] = False
                return False
            order.append(current)
            for name in reads:
                if name not in seen:
                    seen.add(name)
                    stack.append(name)
        for current in order:
            proven[current] = True
        return True

    for k, view in enumerate(views):
        operand = view.gradient_operand
        if view.upstream_gradient or operand in owner or operand not in fused.producer:
            continue
        negated = _negated_output(fused, fused.producer[operand], owner, k)
        if negated:
            view.negated_upstream = negated
        elif view.original_gradient and reach(operand) and prove(operand):
            view.upstream_gradient = operand


def _negated_output(side: "_Side", position: int, owner: Mapping[str, int], own: int) -> str:
    """The value ``y`` when node ``position`` of ``side`` is a plain ``Neg(y)`` (default domain, no attributes, no
    overload, top-level) of an output of another update than ``own`` (``owner``: compared output → its view),
    else "" (:attr:`_UpdateView.negated_upstream`)."""
    node = side.nodes[position]
    if (node.op_type != "Neg" or node.domain not in ("", "ai.onnx") or node.attribute or node.overload
            or side.subgraph[position] or len(side.reads[position]) != 1):
        return ""
    (value,) = side.reads[position]
    return value if owner.get(value, own) != own else ""


def _rename_reads(node: onnx.NodeProto, renames: Mapping[str, str]) -> None:
    """Make ``node`` read ``renames[name]`` wherever it reads ``name``: its inputs, and the outer-scope references
    of its subgraphs (an ``If`` branch that logs ``ReduceSumSquare(w_out)`` reads ``w_out`` from the enclosing
    graph, not through an input), except where a subgraph defines that name itself."""
    for slot, name in enumerate(node.input):
        if name in renames:
            node.input[slot] = renames[name]
    for attribute in node.attribute:
        for sub in [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else list(attribute.graphs):
            defined = {i.name for i in sub.input} | {t.name for t in sub.initializer} | {o for n in sub.node for o in n.output}
            inner = {name: new for name, new in renames.items() if name not in defined}
            if inner:
                for child in sub.node:
                    _rename_reads(child, inner)


def _probe_original_gradients(side: _Side, views: Sequence[_UpdateView]) -> None:
    """Make the value each view's fused SGD node reads as its gradient an output of the original (``side``) too,
    where the original computes a value of that name (:attr:`_UpdateView.original_gradient`). The rewrite keeps
    the nodes that compute a gradient, so a gradient read as it is has the same name in both models; one read
    through a helper of the rewrite (a ``Cast``, a scaled copy) has none, and its update gets no probe. A fed
    gradient needs none: both sides are fed the same values, so it never differs between them. The value
    itself is the output (no ``Identity``), so the nodes of every group, and how groups are packed, stay as
    they were."""
    outputs = set(side.outputs)
    added: list[str] = []
    for view in views:
        if view.gradient_operand and view.gradient_operand in side.producer:
            view.original_gradient = view.gradient_operand
            if view.gradient_operand not in outputs:
                outputs.add(view.gradient_operand)
                added.append(view.gradient_operand)
    side.extend([], added)


def _declared_type(type_proto: onnx.TypeProto) -> tuple | None:
    """``(shape, elem_type)`` of a tensor type (shape None when absent; a dimension is its ``dim_value``, its
    ``dim_param`` or None), None for a type that is no tensor type."""
    if not type_proto.HasField("tensor_type"):
        return None
    tensor_type = type_proto.tensor_type
    shape = None
    if tensor_type.HasField("shape"):
        shape = tuple(int(d.dim_value) if d.HasField("dim_value") else d.dim_param if d.HasField("dim_param") else None
                      for d in tensor_type.shape.dim)
    return shape, tensor_type.elem_type


def _declarations(model: onnx.ModelProto) -> GraphIndex:
    """A :class:`GraphIndex` of ``model``'s declarations alone: inputs, outputs, initializers and the specs
    they declare (no producers or consumers: :func:`check_models` walks nodes in its :class:`_Side` s, and
    builds a full index only when the matcher has to pair the original's state)."""
    graph = model.graph
    specs: dict[str, TensorSpec] = {}
    # Per distinct type (its bytes: equal bytes parse to equal messages), its (shape, elem_type), or None when it
    # is no tensor type: a step has a few dozen types for 100,000s of inputs and outputs.
    read: dict[bytes, tuple | None] = {}
    for info in list(graph.input) + list(graph.output):
        name = info.name
        if name in specs:
            continue
        serialised = info.type.SerializeToString()
        if serialised not in read:
            read[serialised] = _declared_type(onnx.TypeProto.FromString(serialised))
        declared = read[serialised]
        if declared is not None:
            specs[name] = TensorSpec(name, *declared)
    initializers = {t.name: t for t in graph.initializer}
    for name, tensor in initializers.items():
        specs[name] = TensorSpec(name, tuple(int(d) for d in tensor.dims), tensor.data_type)
    return GraphIndex(graph, {}, {}, initializers, [i.name for i in graph.input], [o.name for o in graph.output], specs, set())


def _claim_notes(outputs: Sequence[str], states: set[str], pairs: Mapping[str, str], pinned: Mapping[str, str] | None) -> list[str]:
    """One note per fused state that several of the original's outputs are named after (``buf_out`` and
    ``new_buf``) and no pin decides: which one check carried into it, and how to say another."""
    claims: dict[str, list[str]] = {}
    for output in outputs:
        previous = previous_by_name(output, states)
        if previous is not None:
            claims.setdefault(previous, []).append(output)
    pinned_states = set((pinned or {}).values())
    return [
        f"{', '.join(names)} are each named as the next value of {state}; check carried {pairs.get(state, names[0])} into it "
        f"(say another with --state NEW={state})"
        for state, names in claims.items()
        if len(names) > 1 and state not in pinned_states
    ]


def _original_pairs(
    index: GraphIndex, original: onnx.ModelProto, views: Sequence[_UpdateView], pinned: Mapping[str, str] | None = None
) -> dict[str, str]:
    """state input → the original's next value of it: as pinned (``pinned``: output → input), by name, then by
    matching the original (for the states the fused model updates), then the fused model's own output for it."""
    pairs = _name_evidence(index.graph_outputs, [i for i in index.graph_inputs if i not in index.initializers], pinned)
    wanted = [s for view in views for s in view.roles if s not in pairs]
    if wanted:
        from sgdfuse.passes.index import build_index
        from sgdfuse.passes.linear import Normaliser
        from sgdfuse.passes.sgd_match import find_updates, guarded_outputs

        try:
            matcher_index = build_index(original)  # with shape inference: the matcher reads inferred shapes
            matches, _ = find_updates(matcher_index, Normaliser(matcher_index))
            guards = guarded_outputs(matcher_index)
        except Exception as error:  # the matcher is advisory here: names and the fused pairing remain
            logger.info("matching the original for its state pairs failed: %s", error)
            matches, guards = [], {}
        for match in matches:
            # A guarded update's next state is the guard's output Where(condition, old, new), not its new value.
            for state, new in ((match.parameters, match.parameters_out), (match.accum, match.accum_out)):
                pairs.setdefault(state, guards[new].output if match.guard is not None and new in guards else new)
    outputs = set(index.graph_outputs)
    for view in views:
        for state, output in view.fused_state.items():
            if state not in pairs and output in outputs:
                pairs[state] = output
    return pairs


def _check_inputs(index: GraphIndex, names: Sequence[str], views: Sequence[_UpdateView], side: _Side) -> list[_Input]:
    """The fed inputs of a whole model, with roles: SGD-updated state, what the SGD nodes' gradients and
    coefficients are computed from (in the fused model, ``side``), other state (by name), and the rest."""
    roles = {s: ("parameters" if role == "w" else "accum") for view in views for s, role in view.roles.items()}
    gradient_sources = side.sources([view.gradient for view in views])
    coefficient_sources = side.sources([v for view in views for v in (view.learning_rate, view.momentum)])
    if side.copies:  # the nodes after the table's are the probes, Identity(value) -> name
        known = len(side.nodes) - len(side.copies)
        non_negative = non_negative_inputs(side.nodes[:known], op_types=side.op_types[:known], identities=side.copies)
    else:
        non_negative = non_negative_inputs(side.nodes, op_types=side.op_types)
    inputs = []
    for name in names:
        spec = index.spec(name)
        if spec.shape is None or any(d is None for d in spec.shape):
            raise ValueError(f"cannot check: the shape of input {name} is unknown")
        role = roles.get(name) or ("non-negative" if name in non_negative else "coefficient" if name in coefficient_sources else
                                   "gradient" if name in gradient_sources else "other")
        inputs.append(_Input(name, spec.dtype, tuple(spec.shape), role))
    return inputs


_NON_NEGATIVE_OPERANDS = {("BatchNormalization", 4), ("Sqrt", 0), ("Log", 0)}
"""(op, input position) where only non-negative values are defined: a variance, a square root, a logarithm."""
_NON_NEGATIVE_OPS = frozenset(op for op, _ in _NON_NEGATIVE_OPERANDS)
_COPY_OPS = frozenset({"Identity", "Cast"})


def non_negative_inputs(nodes: Sequence[onnx.NodeProto], *, op_types: Sequence[str] | None = None,
                        identities: Sequence[tuple[str, str]] = ()) -> set[str]:
    """Values read (directly or through ``Identity``/``Cast``) where only non-negative values are defined
    (:data:`_NON_NEGATIVE_OPERANDS`): a check feeds them |x|, as a model's own data would be (a frozen
    BatchNormalization's running variance). ``op_types``: each node's ``op_type``, when the caller has them
    (then only the nodes that matter are read). ``identities``: ``(input, output)`` of further ``Identity``
    nodes of one input and one output after ``nodes`` (as if they were listed there)."""
    copies: dict[str, str] = {}
    readers: list[onnx.NodeProto] = []
    for node, op_type in zip(nodes, op_types, strict=True) if op_types is not None else ((node, node.op_type) for node in nodes):
        # one read of each node's op type; inputs only of the few nodes that matter
        if op_type in _COPY_OPS:
            if node.input and node.output:
                copies[node.output[0]] = node.input[0]
        elif op_type in _NON_NEGATIVE_OPS:
            readers.append(node)
    for value, output in identities:
        copies[output] = value
    found: set[str] = set()
    for node in readers:
        for position, name in enumerate(node.input):
            if (node.op_type, position) in _NON_NEGATIVE_OPERANDS and name:
                while name not in found:
                    found.add(name)
                    name = copies.get(name, name)
    return found


def _check_schedule(pair, inputs, views, outputs, fused_names, original_pairs, output_tallies, state_tallies,
                    *, steps: int, size: int | None, seed: int, loose=None, exact: frozenset[str] | set[str] = frozenset(),
                    isolating: bool = True, isolable: frozenset[str] = frozenset()) -> str:
    """One precision at one size of a model of :func:`check_models` groups: the lockstep run (every output),
    the in-place run (state writes), then the extreme-value steps from the lockstep state (with ``isolating``
    the :data:`ISOLATING_KINDS` steps after them, :func:`_isolating_kinds`), and, when some
    update's gradient was not live on any of them, the :data:`WIDE` step (in lockstep, outputs and state
    writes compared). ``views`` are ``(index, view)`` pairs; ``state_tallies`` is keyed by ``(index, state)``.
    Returns a note when the original could not run the wide step (it is skipped, the rest compared), else "".
    ``loose``: ``(name, original value) -> bound`` for an output that is not an update's (None: identical),
    as :func:`check_lowered` compares two implementations of one model; ``exact``: outputs compared bit for bit
    all the same (:func:`check_lowered`'s coefficients computed by correctly rounded operations)."""
    convert = _lifted_array if pair.lifted else (lambda array: array)
    label = _run_label(pair.label, size)
    fused_pairs = dict(original_pairs)
    for _, view in views:
        fused_pairs.update(view.fused_state)
    state_names = set(original_pairs) | set(fused_pairs)
    state = [spec for spec in inputs if spec.name in state_names]
    kinds = _schedule(steps)
    results = []
    isolating_rng = _isolating_rng(seed)
    isolating_kinds = _isolating_kinds(isolating, inputs, isolable)

    def run_step(mode: str, step: int, kind: str, original_feeds: dict, fused_feeds: dict, rng) -> None:
        for spec in inputs:
            if spec.name not in state_names:
                value = convert(_feed(spec, kind, _counter(kind, step, len(kinds)), size, rng, isolable=spec.name in isolable))
                original_feeds[spec.name] = fused_feeds[spec.name] = value
        original_out = _run_side(pair.original, original_feeds, outputs, "original model")
        fused_out = _run_side(pair.fused, fused_feeds, fused_names, "fused model")
        results.append((mode, step, kind, original_feeds, fused_feeds, original_out, fused_out))

    for mode in ("lockstep", "in place"):
        rng = np.random.default_rng(seed)
        original_feeds: dict[str, np.ndarray] = {spec.name: convert(_state_initial(spec, size, rng)) for spec in state}
        fused_feeds = dict(original_feeds)
        sequence = kinds + ([*EXTRA_KINDS, RANDOM_STATE, *isolating_kinds] if mode == "lockstep" else [])
        base = None
        for step, kind in enumerate(sequence):
            unchained = kind in EXTRA_KINDS or kind == RANDOM_STATE or kind in ISOLATING_KINDS
            if unchained:
                base = base or (dict(original_feeds), dict(fused_feeds))
                original_feeds, fused_feeds = dict(base[0]), dict(base[1])
            if kind == RANDOM_STATE or kind == "restart":
                _random_buffers(state, original_feeds, fused_feeds, size, rng, convert, only_zero=kind == "restart")
            if kind in ISOLATING_KINDS:
                _isolating_state(kind, state, original_feeds, fused_feeds, size, isolating_rng, convert, isolable)
            run_step(mode, step, kind, original_feeds, fused_feeds, isolating_rng if kind in ISOLATING_KINDS else rng)
            if not unchained:
                original_out, fused_out = results[-1][5:]
                original_feeds, fused_feeds = dict(original_feeds), dict(fused_feeds)
                _carry(original_feeds, original_out, original_pairs)
                if mode == "lockstep":
                    fused_feeds = dict(original_feeds)
                else:
                    _carry(fused_feeds, fused_out, fused_pairs)
        if mode == "lockstep":
            lockstep_base, lockstep_rng, wide_step = base, rng, len(sequence)
    plain_views = [view for _, view in views]
    known = [any(t.gradient_seen for t in _view_tallies(k, view, output_tallies, state_tallies)) for k, view in views]
    live = _live_views(plain_views, [(o_in, o_out, f_out) for *_, o_in, _, o_out, f_out in results], known)
    skipped = ""
    if not all(live):
        original_feeds, fused_feeds = dict(lockstep_base[0]), dict(lockstep_base[1])
        _random_buffers(state, original_feeds, fused_feeds, size, lockstep_rng, convert)
        try:
            run_step("lockstep", wide_step, WIDE, original_feeds, fused_feeds, lockstep_rng)
        except _RunError as error:
            if not error.original:
                raise  # the fused model fails where the original runs: a failure, as on any step
            skipped = f"{label}: the wide-range step could not run: {error} (skipped)"
        else:
            o_in, o_out, f_out = results[-1][3], results[-1][5], results[-1][6]
            live = [seen or _view_live(view, o_in, o_out, f_out) for view, seen in zip(plain_views, live)]
    for mode, step, kind, original_in, fused_in, original_out, fused_out in results:
        step_label = f"{label}, {mode} step {step + 1} ({kind})"
        _compare_check_step(views, outputs, output_tallies, state_tallies, step_label, original_in, fused_in, original_out,
                            fused_out, lifted=pair.lifted, outputs_compared=mode == "lockstep",
                            in_place=mode != "lockstep" or kind == WIDE, finite_only=kind == WIDE,
                            carried=mode == "in place" or loose is not None, loose=loose, exact=exact)
    for (k, view), seen in zip(views, live):
        if seen:
            for tally in _view_tallies(k, view, output_tallies, state_tallies):
                tally.gradient_seen = True
    return skipped


def _view_tallies(k: int, view: _UpdateView, output_tallies: Mapping, state_tallies: Mapping) -> list[_Tally]:
    """The tallies of update ``k`` of :func:`check_models`: its outputs (those that are graph outputs) and
    its state writes."""
    return [output_tallies[name] for name in view.outputs if name in output_tallies] + [state_tallies[(k, s)] for s in view.roles]


def _compare_check_step(views, outputs, output_tallies, state_tallies, step_label: str, original_in, fused_in, original_out,
                        fused_out, *, lifted: bool, outputs_compared: bool, in_place: bool, finite_only: bool,
                        carried: bool = False, loose=None, exact: frozenset[str] | set[str] = frozenset()) -> None:
    """Compare one step of :func:`_check_schedule`: with ``outputs_compared`` (lockstep) every output (exactly,
    or within the bound for an update's), with ``in_place`` what each side writes into each state;
    ``finite_only`` (a :data:`WIDE` step) leaves out elements not finite on either side."""
    update_outputs = {name for _, view in views for name in view.outputs}
    if outputs_compared:
        for name in outputs:
            if name not in update_outputs and name in output_tallies:  # not a probe
                bound = 0.0 if loose is None or name in exact else functools.partial(loose, name, original_out[name])
                output_tallies[name].compare(f"{step_label}", original_out[name], fused_out[name], bound, finite_only=finite_only)
    for k, view in views:
        bounds = _lazy_bounds(view, original_in, fused_in, original_out, fused_out, lifted=lifted, carried=carried)
        if outputs_compared:
            for name, role in view.outputs.items():
                if name in output_tallies:
                    output_tallies[name].compare(step_label, original_out[name], fused_out[name], bounds[role], finite_only=finite_only)
        if in_place:
            for state, role in view.roles.items():
                original_next = view.original_state.get(state)
                fused_next = view.fused_state.get(state)
                want = original_out[original_next] if original_next in original_out else original_in[state]
                have = fused_out[fused_next] if fused_next in fused_out else fused_in[state]
                state_tallies[(k, state)].compare(
                    f"{step_label}: {state} becomes {fused_next} on the fused side and {original_next or state + ' (unchanged)'} in the original",
                    want, have, bounds[role], finite_only=finite_only,
                )

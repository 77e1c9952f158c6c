"""Is a fused model slower than the original in onnxruntime? (issue 18)

For each case it builds a training step of momentum-SGD updates written as PyTorch's dynamo exporter writes
them (rank-0 scalar initializers shared by every update; ``Mul``/``Add``), fuses it with
``sgdfuse.optimize(verify=False)`` (what ``sgdfuse optimize --no-verify`` does), and times in one process,
interleaved run by run, on onnxruntime's CPU provider:

  original      the step as exported;
  general       the fused step with every SGD node calling the general body (the overload "", what sgdfuse
                wrote before the bodies were specialised);
  specialised   the fused step as sgdfuse writes it (each node calls the body specialised to what the
                rewrite proved);
  native        the same fused step with sgdfuse's native kernel registered (sgdfuse.ortkernel), which
                onnxruntime runs for every SGD node instead of its function body.

Parameters, gradients and buffers are graph inputs fed every run, as a training step is. It reports the
median of --runs runs after --warmup runs, the ratio to the original, and the bandwidth each reaches counted
as one pass of the fused op over memory (4 reads + 3 writes of the parameters' size per update), beside a
numpy copy's bandwidth measured in the same process (read + write of a 64 MiB array).

Usage (from the repository root, in the dev venv):
    python bench/ort_step.py [--runs 15] [--warmup 3] [--threads 1] [--cases f32-8x1M-damp ...] [--json FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sgdfuse import api, ortkernel  # noqa: E402
from sgdfuse.fused_op import DOMAIN, OP_TYPE, is_sgd_node, make_sgd_function  # noqa: E402

NP = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}
TAGS = {TensorProto.FLOAT: "f32", TensorProto.FLOAT16: "f16"}


@dataclasses.dataclass(frozen=True)
class Case:
    """``updates`` updates of ``shape`` in ``dtype``; ``variant`` "plain" (lr 0.01, m 0.9) or "damp"
    (and weight decay 1e-4, dampening 0.1, the issue's measurement)."""

    dtype: int
    updates: int
    shape: tuple[int, ...]
    variant: str

    @property
    def name(self) -> str:
        size = f"{self.updates // 1000}k" if self.updates >= 1000 else str(self.updates)
        elements = int(np.prod(self.shape))
        each = f"{elements >> 20}M" if elements >= 1 << 20 else str(elements)
        return f"{TAGS[self.dtype]}-{size}x{each}-{self.variant}"


CASES = [
    Case(dtype, updates, shape, variant)
    for dtype in (TensorProto.FLOAT, TensorProto.FLOAT16)
    for updates, shape in ((8, (1 << 20,)), (10_000, (16,)))
    for variant in ("plain", "damp")
]


def build_step(case: Case) -> onnx.ModelProto:
    """The exported step: per update ``[grad = g + p*wd]``, ``buf' = buf*m + grad[*(1-d)]``,
    ``p' = p + buf'*(-lr)``."""
    dtype, np_dtype = case.dtype, NP[case.dtype]
    lr, m = 0.01, 0.9
    wd, d = (1e-4, 0.1) if case.variant == "damp" else (0.0, 0.0)
    initializers, scalars = [], {}

    def scalar(value: float) -> str:
        if value not in scalars:
            scalars[value] = f"scalar_{len(scalars)}"
            initializers.append(numpy_helper.from_array(np.array(value, dtype=np_dtype), scalars[value]))
        return scalars[value]

    nodes, inputs, outputs = [], [], []
    shape = list(case.shape)
    for i in range(case.updates):
        p, g, buf = f"p{i}", f"grad_p{i}", f"buf_p{i}"
        inputs += [helper.make_tensor_value_info(name, dtype, shape) for name in (p, g, buf)]
        grad = g
        if wd:
            nodes.append(helper.make_node("Mul", [p, scalar(wd)], [f"p_wd{i}"]))
            nodes.append(helper.make_node("Add", [g, f"p_wd{i}"], [f"grad{i}"]))
            grad = f"grad{i}"
        nodes.append(helper.make_node("Mul", [buf, scalar(m)], [f"buf_m{i}"]))
        if d:
            nodes.append(helper.make_node("Mul", [grad, scalar(1.0 - d)], [f"grad_d{i}"]))
            grad = f"grad_d{i}"
        nodes.append(helper.make_node("Add", [f"buf_m{i}", grad], [f"{buf}_out"]))
        nodes.append(helper.make_node("Mul", [f"{buf}_out", scalar(-lr)], [f"step{i}"]))
        nodes.append(helper.make_node("Add", [p, f"step{i}"], [f"{p}_out"]))
        outputs += [helper.make_tensor_value_info(name, dtype, shape) for name in (f"{p}_out", f"{buf}_out")]
    graph = helper.make_graph(nodes, "step", inputs, outputs, initializer=initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def with_general_body(fused: onnx.ModelProto) -> onnx.ModelProto:
    """``fused`` with every SGD node calling the general body (overload "")."""
    model = onnx.ModelProto()
    model.CopyFrom(fused)
    for node in model.graph.node:
        if is_sgd_node(node):
            node.ClearField("overload")
    kept = [f for f in model.functions if not (f.domain == DOMAIN and f.name == OP_TYPE)]
    del model.functions[:]
    model.functions.extend(kept + [make_sgd_function(18)])
    return model


def session(model: onnx.ModelProto, threads: int, native: bool = False) -> ort.InferenceSession:
    options = ort.SessionOptions()
    if native:
        ortkernel.register(options)
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def feeds_for(case: Case, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    result = {}
    for i in range(case.updates):
        for name, scale in ((f"p{i}", 1.0), (f"grad_p{i}", 0.1), (f"buf_p{i}", 0.1)):
            result[name] = (rng.standard_normal(case.shape) * scale).astype(NP[case.dtype])
    return result


def copy_bandwidth(runs: int = 15, size: int = 64 << 20) -> float:
    """numpy's copy bandwidth in GB/s: ``size`` bytes read and written per copy, median of ``runs``."""
    source = np.ones(size // 4, dtype=np.float32)
    target = np.empty_like(source)
    np.copyto(target, source)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        np.copyto(target, source)
        times.append(time.perf_counter() - start)
    return 2 * size / statistics.median(times) / 1e9


def measure(case: Case, runs: int, warmup: int, threads: int, general_max: int) -> dict:
    original = build_step(case)
    result = api.optimize(original, verify=False)
    fused = result.model
    fused_count = sum(1 for n in fused.graph.node if is_sgd_node(n))
    if fused_count != case.updates:
        raise SystemExit(f"{case.name}: {fused_count} of {case.updates} updates fused")
    models = {"original": original, "general": with_general_body(fused), "specialised": fused, "native": fused}
    if case.updates > general_max:
        # onnxruntime's session creation with the general body is superlinear in the number of nodes that
        # call it (88 s at 2,000 updates of 16 elements; 10,000 did not finish in 20 minutes).
        del models["general"]
    sessions, session_seconds = {}, {}
    for name, model in models.items():
        start = time.perf_counter()
        sessions[name] = session(model, threads, native=name == "native")
        session_seconds[name] = time.perf_counter() - start
    # Inputs and outputs bound once (IOBinding, preallocated outputs): a run times onnxruntime's execution,
    # not the Python binding's conversion of 30,000 feeds and 20,000 results.
    feeds = {name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in feeds_for(case).items()}
    results = {o.name: ort.OrtValue.ortvalue_from_numpy(np.zeros(case.shape, NP[case.dtype])) for o in original.graph.output}
    bindings = {}
    for name, s in sessions.items():
        binding = s.io_binding()
        for feed, value in feeds.items():
            binding.bind_ortvalue_input(feed, value)
        for output, value in results.items():
            binding.bind_ortvalue_output(output, value)
        bindings[name] = binding
    for _ in range(warmup):
        for name, s in sessions.items():
            s.run_with_iobinding(bindings[name])
    times: dict[str, list[float]] = {name: [] for name in sessions}
    order = list(sessions)
    for r in range(runs):
        for name in order if r % 2 == 0 else reversed(order):  # interleaved, alternating who goes first
            start = time.perf_counter()
            sessions[name].run_with_iobinding(bindings[name])
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) for name, values in times.items()}
    elements = case.updates * int(np.prod(case.shape))
    one_pass = 7 * elements * np.dtype(NP[case.dtype]).itemsize
    overloads = sorted({n.overload for n in fused.graph.node if is_sgd_node(n)})
    return {
        "case": case.name,
        "updates": case.updates,
        "elements": elements,
        "overloads": overloads,
        "sessions_s": session_seconds,
        "ms": {name: value * 1e3 for name, value in medians.items()},
        "ratio": {name: value / medians["original"] for name, value in medians.items()},
        "gbps": {name: one_pass / value / 1e9 for name, value in medians.items()},
        "body_nodes": {f.overload: len(f.node) for f in fused.functions},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads (default 1)")
    parser.add_argument("--cases", nargs="*", help="case names (default: all): " + " ".join(c.name for c in CASES))
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--general-max-updates", type=int, default=100, help="time the general body only up to this many updates")
    args = parser.parse_args(argv)
    cases = [c for c in CASES if not args.cases or c.name in args.cases]

    copy_before = copy_bandwidth()
    rows = []
    header = (f"{'case':22} {'original ms':>11} {'general ms':>10} {'x orig':>6} {'spec. ms':>9} {'x orig':>6} "
              f"{'native ms':>9} {'x orig':>6}  {'GB/s orig':>9} {'GB/s spec.':>10} {'GB/s nat.':>9}")
    print(f"onnxruntime {ort.__version__}, CPU, {args.threads} intra-op thread(s), {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores; median of {args.runs} interleaved runs after {args.warmup} warm-up")
    kernel = ortkernel.build_kernel()
    print(f"native kernel: {kernel.path} (C API {kernel.api_version} headers, {kernel.compiler_version}, "
          f"{'cached' if kernel.cached else f'built in {kernel.seconds:.1f} s'})")
    print(f"numpy copy bandwidth (read + write): {copy_before:.1f} GB/s")
    print(header)
    print("-" * len(header))
    for case in cases:
        row = measure(case, args.runs, args.warmup, args.threads, args.general_max_updates)
        rows.append(row)
        ms, ratio, gbps = row["ms"], row["ratio"], row["gbps"]
        general = f"{ms['general']:10.2f} {ratio['general']:6.2f}" if "general" in ms else f"{'-':>10} {'-':>6}"
        print(
            f"{row['case']:22} {ms['original']:11.2f} {general} {ms['specialised']:9.2f} "
            f"{ratio['specialised']:6.2f} {ms['native']:9.2f} {ratio['native']:6.2f}  {gbps['original']:9.3g} "
            f"{gbps['specialised']:10.3g} {gbps['native']:9.3g}",
            flush=True,
        )
    copy_after = copy_bandwidth()
    print(f"numpy copy bandwidth after the runs: {copy_after:.1f} GB/s")
    print("GB/s: 7 x the parameters' bytes per update (one pass of the fused op: 4 reads + 3 writes) / median time")
    print("\nbodies (overload: nodes) and session creation (s):")
    for row in rows:
        print(f"  {row['case']}: " + ", ".join(f"{k or 'general'}: {v}" for k, v in row["body_nodes"].items())
              + "; sessions " + ", ".join(f"{k} {v:.1f}" for k, v in row["sessions_s"].items()))
    print("\ntargets (issue 18): fused <= 1.0x the original everywhere, <= 0.7x at 8x1M FLOAT")
    for row in rows:
        limit = 0.7 if row["case"].startswith("f32-8x1M") else 1.0
        for column in ("specialised", "native"):
            verdict = "MET " if row["ratio"][column] <= limit else "MISS"
            print(f"  {verdict} {row['case']} {column}: {row['ratio'][column]:.2f}x (target <= {limit})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_gbps": [copy_before, copy_after], "threads": args.threads, "runs": args.runs, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

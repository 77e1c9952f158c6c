"""Benchmark sgdfuse against the cost of reading and writing the file once (issue 7).

On the same generated files (bench/generate.py) it times, each measurement in a fresh Python subprocess:

  floor        onnx.load + onnx.save
  load         onnx.load alone (for the peak-RSS reference)
  no-verify    sgdfuse.optimize(path, verify=False) + result.save(out)   (= `sgdfuse optimize --no-verify`)
  verify       sgdfuse.optimize(path, verify=True) + result.save(out)    (= `sgdfuse optimize`)
  onnxscript   onnx.load + onnxscript.rewriter.rewrite(model, [one MomentumSGD rule]) + onnx.save
  check        `sgdfuse check FILE FUSED --steps 3` (FUSED: the no-verify row's output, which runs first)
  lower        `sgdfuse lower FUSED --soc Ascend910B2` (with its verification of the GE graph)
               (peer baseline: one rule for the simplest form, buf' = buf*m + g; p' = p + buf'*(-lr))

Times are measured inside the child from just before the load to just after the save (interpreter start and
imports excluded); peak RSS is the child's whole-process peak resident set (VmHWM, imports included). It prints
the median of --runs runs per cell, the ratio to the floor, peak RSS, the log-log slope of time against the
number of updates, and checks that every generated update was fused and every unrelated node left as it was
(against the manifest bench/generate.py writes). --profile SIZE... profiles `optimize --no-verify` with
cProfile (stopped after --profile-budget seconds, so a quadratic run still yields its hot spots).

Usage (from the repository root, in the dev venv with onnxscript installed):
    python bench/run.py [--sizes 1000 10000 50000] [--runs 3] [--dir /tmp/sgdfuse-bench] [--profile 10000 50000]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

MODES = ("load", "floor", "no-verify", "verify", "onnxscript", "check", "lower")
TARGETS = {"ratio": 3.0, "slope": 1.1, "rss": 2.0}
RATIO_TARGETS = {"no-verify": 3.0, "verify": 6.0, "check": 10.0, "lower": 5.0}
"""Issue 12: the most time each command may take, as a multiple of the floor (load + save) of the same run,
at 10k and 50k updates (verify, check and lower: at 50k; they are shown against it at 10k too)."""
CLI_MODES = ("check", "lower")


# ----------------------------------------------------------------------------------------------------------
# The onnxscript peer baseline: one pattern rule with the public rewriter API.
# ----------------------------------------------------------------------------------------------------------
def onnxscript_rule():
    """A ``RewriteRule`` fusing the simplest exported form (dynamo/legacy, m > 0, d = wd = 0, not Nesterov):

        buf_out = Add(Mul(buf, m), g);   p_out = Add(p, Mul(buf_out, neg_lr))

    into ``ai.sgdfuse::SGD(p, g, Neg(neg_lr), buf, m, ConstantOfShape(Shape(p)))`` (stat = 0, as sgdfuse does
    for a step after the first). ``m`` and ``neg_lr`` must be scalars (rank-0 constants or Constant outputs).
    """
    from onnxscript.rewriter import pattern

    def is_scalar(value) -> bool:
        if value is None:
            return False
        if value.const_value is not None:
            return value.const_value.size == 1
        producer = value.producer()
        if producer is not None and producer.op_type == "Constant":
            return True
        return value.shape is not None and len(value.shape) == 0

    def target(op, p, buf, g, m, neg_lr):
        buf_out = op.Add(op.Mul(buf, m), g)
        p_out = op.Add(p, op.Mul(buf_out, neg_lr))
        return p_out, buf_out

    def condition(context, p, buf, g, m, neg_lr, **_):
        return is_scalar(m) and is_scalar(neg_lr)

    def replacement(op, p, buf, g, m, neg_lr):
        stat = op.ConstantOfShape(op.Shape(p))
        p_out, buf_out, _ = op.SGD(
            p, g, op.Neg(neg_lr), buf, m, stat, _domain="ai.sgdfuse", _outputs=3, dampening=0.0, weight_decay=0.0, nesterov=0
        )
        return p_out, buf_out

    return pattern.RewriteRule(target, replacement, condition, name="MomentumSGD")


# ----------------------------------------------------------------------------------------------------------
# Child side: one measurement per process.
# ----------------------------------------------------------------------------------------------------------
def _status_kb(field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (peak) of this process in kB, from /proc (0 where there is none).

    VmHWM is the peak of this process image since exec; ``ru_maxrss`` is not used for the peak because Linux
    carries over the forking parent's resident size into it."""
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def worker(mode: str, path: str, out: str) -> dict:
    import onnx

    result: dict = {}
    if mode in ("no-verify", "verify", "profile"):
        import sgdfuse
    if mode == "onnxscript":
        from onnxscript import rewriter

        rule = onnxscript_rule()
    result["rss_after_import_kb"] = _status_kb("VmRSS")
    start = time.perf_counter()
    cpu_start = time.process_time()
    if mode == "load":
        model = onnx.load(path)
    elif mode == "floor":
        model = onnx.load(path)
        onnx.save(model, out)
    elif mode in ("no-verify", "verify"):
        fused = sgdfuse.optimize(path, verify=mode == "verify")
        fused.save(out)
    elif mode == "onnxscript":
        model = rewriter.rewrite(onnx.load(path), pattern_rewrite_rules=[rule])
        onnx.save(model, out)
    elif mode in CLI_MODES:
        result["exit"] = _cli(mode, path, out)
    else:
        raise SystemExit(f"unknown mode {mode}")
    result["seconds"] = time.perf_counter() - start
    # CPU time of this process (all its threads): on a machine shared with other jobs it is the steadier
    # measure, since waiting for a core does not count.
    result["cpu_seconds"] = time.process_time() - cpu_start
    result["peak_rss_kb"] = _status_kb("VmHWM")
    if mode in ("no-verify", "verify"):
        report = fused.report
        result["fused"] = len(report.fused)
        reasons: dict[str, int] = {}
        for refusal in report.refused:
            reasons[refusal.reason] = reasons.get(refusal.reason, 0) + 1
        result["refused_reasons"] = reasons
        result["refused"] = [[r.candidate, r.reason, r.detail] for r in report.refused]
        if mode == "verify":
            result["verified"] = len(report.verification.updates)
            result["verification_passed"] = report.verification.passed
    if mode == "onnxscript":
        result["sgd_nodes"] = sum(1 for n in model.graph.node if n.op_type == "SGD" and n.domain == "ai.sgdfuse")
    return result


def _cli(mode: str, path: str, out: str) -> int:
    """Run ``sgdfuse check`` or ``sgdfuse lower`` in this process on the no-verify row's output; its exit code."""
    import contextlib
    import io

    from sgdfuse.cli import main as cli

    fused = os.path.join(os.path.dirname(out), "no-verify_" + os.path.basename(out).split("_", 1)[1])
    if not os.path.exists(fused):
        raise SystemExit(f"{fused} is missing: run the no-verify row first")
    if mode == "check":
        argv = ["check", path, fused, "--steps", "3"]
    else:
        argv = ["lower", fused, "--soc", "Ascend910B2", "-o", out[: -len(".onnx")] + ".air"]
    console = io.StringIO()
    try:
        with contextlib.redirect_stdout(console):
            cli(argv)
    except SystemExit as stop:
        return int(stop.code or 0)
    return 0


class _Budget(Exception):
    pass


def profile_worker(path: str, budget: float, top: int) -> dict:
    """cProfile of optimize(verify=False) + save, stopped after ``budget`` seconds."""
    import cProfile
    import io
    import pstats

    import sgdfuse

    def stop(signum, frame):
        raise _Budget()

    profiler = cProfile.Profile()
    signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, budget)
    start = time.perf_counter()
    complete = True
    profiler.enable()
    try:
        sgdfuse.optimize(path, verify=False).save(os.devnull)
    except _Budget:
        complete = False
    finally:
        profiler.disable()
        signal.setitimer(signal.ITIMER_REAL, 0)
    elapsed = time.perf_counter() - start
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("cumulative").print_stats(r"sgdfuse", top)
    stats.sort_stats("tottime").print_stats(top)
    return {"seconds": elapsed, "complete": complete, "text": text.getvalue()}


def check_worker(original: str, fused: str, manifest_path: str) -> dict:
    """Did the fused file fuse every generated update and keep every unrelated node as it was?"""
    import onnx

    with open(manifest_path, encoding="utf-8") as handle:
        manifest = json.load(handle)
    before = onnx.load(original)
    after = onnx.load(fused)
    sgd = [n for n in after.graph.node if n.op_type == "SGD" and n.domain == "ai.sgdfuse"]
    produced = {}
    for n in sgd:
        produced[n.output[0]] = n
    not_fused: dict[str, list[str]] = {}
    wrong_wiring = []
    for update in manifest["updates"]:
        node = produced.get(update["parameters_out"])
        form = f"{update['family']}/{update['variant']}"
        if node is None:
            not_fused.setdefault(form, []).append(update["parameters_out"])
        elif node.output[1] != update["accum_out"] or node.input[0] != update["parameters"] or node.input[3] != update["accum"]:
            wrong_wiring.append(update["parameters_out"])
    before_by_name = {n.name: n for n in before.graph.node}
    after_by_name = {n.name: n for n in after.graph.node}
    changed = []
    for name in manifest["unrelated_nodes"]:
        old, new = before_by_name[name], after_by_name.get(name)
        if new is None or new.SerializeToString(deterministic=True) != old.SerializeToString(deterministic=True):
            changed.append(name)
    outputs_before = [o.name for o in before.graph.output]
    outputs_after = [o.name for o in after.graph.output]
    return {
        "expected": manifest["momentum_updates"],
        "sgd_nodes": len(sgd),
        "not_fused": not_fused,
        "wrong_wiring": wrong_wiring,
        "unrelated": len(manifest["unrelated_nodes"]),
        "unrelated_changed": changed,
        "outputs_kept": outputs_before == outputs_after,
        "forms": manifest["forms"],
    }


# ----------------------------------------------------------------------------------------------------------
# Parent side.
# ----------------------------------------------------------------------------------------------------------
def run_child(args: list[str], timeout: float) -> tuple[dict | None, int, float, str]:
    """Run ``python run.py --worker ...``; returns (result, peak RSS kB, wall seconds, error)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        process = subprocess.Popen([sys.executable, os.path.abspath(__file__), *args], stdout=out, stderr=err)
        deadline = start + timeout
        while True:
            pid, status, usage = os.wait4(process.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                process.kill()
                pid, status, usage = os.wait4(process.pid, 0)
                process.returncode = -9
                return None, usage.ru_maxrss, time.perf_counter() - start, f"timeout after {timeout:.0f} s"
            time.sleep(0.01)
        wall = time.perf_counter() - start
        process.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        text = out.read().decode("utf-8", "replace")
        if process.returncode != 0:
            return None, usage.ru_maxrss, wall, f"exit {process.returncode}: {_last_line(err)}"
        return json.loads(text.strip().splitlines()[-1]), usage.ru_maxrss, wall, ""


def _last_line(handle) -> str:
    handle.seek(0)
    lines = handle.read().decode("utf-8", "replace").strip().splitlines()
    return lines[-1] if lines else ""


def _select_sgdfuse(rev: str | None) -> str:
    """Where the children import sgdfuse from (and, with ``rev``, set that up); returns a description."""
    import importlib.util

    root = os.path.dirname(HERE)
    if rev:
        commit = subprocess.run(["git", "-C", root, "rev-parse", rev], check=True, capture_output=True, text=True).stdout.strip()
        target = os.path.join(tempfile.gettempdir(), f"sgdfuse-bench-src-{commit[:12]}")
        if not os.path.isdir(os.path.join(target, "sgdfuse")):
            os.makedirs(target, exist_ok=True)
            archive = subprocess.run(["git", "-C", root, "archive", commit, "sgdfuse"], check=True, capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", target], input=archive, check=True)
        os.environ["PYTHONPATH"] = target + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
        last = subprocess.run(["git", "-C", root, "log", "-1", "--format=%h %s", commit, "--", "sgdfuse"], capture_output=True, text=True).stdout.strip()
        return f"git {rev} = {commit[:12]}, package last changed in {last[:90]} (exported to {target})"
    spec = importlib.util.find_spec("sgdfuse")
    if spec is None or spec.origin is None:
        return "sgdfuse not importable"
    where = os.path.dirname(os.path.dirname(spec.origin))
    state = subprocess.run(["git", "-C", where, "describe", "--always", "--dirty"], capture_output=True, text=True)
    return f"{spec.origin}" + (f" (git {state.stdout.strip()})" if state.returncode == 0 else "")


def fmt_seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if value < 10 else f"{value:.1f}"


def fmt_mb(kb: float | None) -> str:
    return "-" if kb is None else f"{kb / 1024:.0f}"


def slope(points: list[tuple[int, float]]) -> float | None:
    points = [(n, t) for n, t in points if t]
    if len(points) < 2:
        return None
    (n0, t0), (n1, t1) = points[0], points[-1]
    return math.log(t1 / t0) / math.log(n1 / n0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        mode, *rest = argv[1:]
        if mode == "manifest":
            result = check_worker(*rest)
        elif mode == "profile":
            result = profile_worker(rest[0], float(rest[1]), int(rest[2]))
        else:
            result = worker(mode, *rest)
        print(json.dumps(result))
        return 0

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 50000], help="momentum updates per file")
    parser.add_argument("--runs", type=int, default=3, help="runs per cell (median reported)")
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "sgdfuse-bench"), help="where the generated files live")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--onnxscript-max", type=int, default=10000, help="skip the onnxscript baseline above this size (it is quadratic)")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds before a measurement is killed")
    parser.add_argument("--single-run-above", type=float, default=120, help="a cell whose first run took longer is not repeated")
    parser.add_argument("--profile", type=int, nargs="*", default=None, help="sizes to profile optimize --no-verify on (cProfile)")
    parser.add_argument("--profile-budget", type=float, default=120, help="seconds of profiling per size (partial profile past it)")
    parser.add_argument("--profile-top", type=int, default=25)
    parser.add_argument("--json", help="also write all raw measurements here")
    parser.add_argument(
        "--rev",
        help="measure the sgdfuse package of this git revision (git archive into a temporary directory, put first on "
        "PYTHONPATH) instead of the importable one; keeps a run stable while the work tree changes",
    )
    args = parser.parse_args(argv)
    if any(mode in CLI_MODES for mode in args.modes) and "no-verify" not in args.modes:
        args.modes.append("no-verify")  # check and lower read its output
    args.modes = sorted(dict.fromkeys(args.modes), key=MODES.index)
    source = _select_sgdfuse(args.rev)

    sizes = sorted(args.sizes)
    os.makedirs(args.dir, exist_ok=True)
    paths = {}
    for n in sizes:
        path = os.path.join(args.dir, f"sgd_bench_{n}.onnx")
        stamp = os.path.join(args.dir, f"sgd_bench_{n}.seed")
        # The seed and the generator's own bytes: a changed generator makes its files again.
        with open(os.path.join(HERE, "generate.py"), "rb") as handle:
            wanted = f"{args.seed} {hashlib.sha256(handle.read()).hexdigest()[:16]}"
        if not (os.path.exists(path) and os.path.exists(stamp) and open(stamp).read() == wanted):
            start = time.perf_counter()
            # In a child, so that this process stays small.
            subprocess.run([sys.executable, os.path.join(HERE, "generate.py"), args.dir, "--sizes", str(n), "--seed", str(args.seed)], check=True)
            with open(stamp, "w") as handle:
                handle.write(wanted)
            print(f"generated {path} ({os.path.getsize(path) / 1e6:.1f} MB) in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        paths[n] = path

    import onnx

    print(f"sgdfuse benchmark: python {platform.python_version()}, onnx {onnx.__version__}, {os.cpu_count()} CPUs, runs per cell {args.runs}")
    print(f"command: python bench/run.py {' '.join(argv)}")
    print(f"sgdfuse measured: {source}")

    results: dict[str, dict[int, dict]] = {mode: {} for mode in args.modes}
    skipped: dict[str, dict[int, str]] = {mode: {} for mode in args.modes}
    checks: dict[int, dict] = {}
    out_dir = tempfile.mkdtemp(prefix="sgdfuse-bench-out-")
    for n in sizes:
        path = paths[n]
        with open(path[: -len(".onnx")] + ".manifest.json", encoding="utf-8") as handle:
            manifest_head = json.load(handle)
        print(f"\n== {n} updates: {os.path.basename(path)}, {os.path.getsize(path) / 1e6:.1f} MB, {manifest_head['nodes']} nodes", file=sys.stderr)
        for mode in args.modes:
            if mode == "onnxscript" and n > args.onnxscript_max:
                skipped[mode][n] = f"skipped above --onnxscript-max {args.onnxscript_max} (quadratic)"
                continue
            if any(reason.startswith("timeout") or reason.startswith("timed out") for size, reason in skipped[mode].items() if size < n):
                skipped[mode][n] = "skipped: timed out at a smaller size"
                continue
            out = os.path.join(out_dir, f"{mode}_{n}.onnx")
            runs = []
            for run in range(args.runs):
                result, rss, wall, error = run_child(["--worker", mode, path, out], args.timeout)
                if result is None:
                    skipped[mode][n] = error
                    print(f"   {mode:10s} run {run + 1}: FAILED {error}", file=sys.stderr)
                    break
                result["maxrss_kb"] = result.get("peak_rss_kb") or rss
                result["wall"] = wall
                runs.append(result)
                print(f"   {mode:10s} run {run + 1}: {result['seconds']:.3f} s, peak RSS {result['maxrss_kb'] / 1024:.0f} MB", file=sys.stderr)
                if mode in ("no-verify", "verify") and run == 0:
                    check, _, _, error = run_child(["--worker", "manifest", path, out, path[: -len(".onnx")] + ".manifest.json"], args.timeout)
                    checks.setdefault(n, {})[mode] = check or {"error": error}
                    checks[n][mode + "_report"] = {k: result.get(k) for k in ("fused", "refused_reasons", "refused", "verified", "verification_passed")}
                if result["seconds"] > args.single_run_above:
                    break
            if runs:
                results[mode][n] = {
                    "seconds": statistics.median(r["seconds"] for r in runs),
                    "cpu_seconds": statistics.median(r.get("cpu_seconds", r["seconds"]) for r in runs),
                    "maxrss_kb": statistics.median(r["maxrss_kb"] for r in runs),
                    "rss_after_import_kb": statistics.median(r["rss_after_import_kb"] for r in runs),
                    "runs": len(runs),
                    "all_seconds": [r["seconds"] for r in runs],
                    "extra": {k: v for k, v in runs[0].items() if k not in ("seconds", "cpu_seconds", "maxrss_kb", "wall", "rss_after_import_kb", "refused")},
                }

    # ---- table -------------------------------------------------------------------------------------
    floor = results.get("floor", {})
    load = results.get("load", {})
    print()
    header = (
        f"{'mode':<12}{'updates':>9}{'runs':>5}{'median s':>10}{'x floor':>9}{'peak RSS MB':>12}{'x load':>8}"
        f"{'import MB':>10}{'growth MB':>10}{'x load':>8}  note"
    )
    print(header)
    print("-" * len(header))
    for mode in args.modes:
        for n in sizes:
            cell = results[mode].get(n)
            if cell is None:
                print(f"{mode:<12}{n:>9}{'':>5}{'-':>10}{'-':>9}{'-':>12}{'-':>8}{'-':>10}{'-':>10}{'-':>8}  {skipped[mode].get(n, '')}")
                continue
            ratio = cell["seconds"] / floor[n]["seconds"] if n in floor else None
            rss_ratio = cell["maxrss_kb"] / load[n]["maxrss_kb"] if n in load else None
            growth = cell["maxrss_kb"] - cell["rss_after_import_kb"]
            load_growth = load[n]["maxrss_kb"] - load[n]["rss_after_import_kb"] if n in load else 0
            growth_ratio = growth / load_growth if load_growth > 0 else None
            note = ""
            if mode == "onnxscript":
                note = f"{cell['extra'].get('sgd_nodes')} SGD nodes (simplest-form rule only)"
            elif mode in ("no-verify", "verify"):
                note = f"fused {cell['extra'].get('fused')}/{n}"
                if mode == "verify":
                    note += f", verified {cell['extra'].get('verified')}, passed {cell['extra'].get('verification_passed')}"
            elif mode in CLI_MODES:
                note = f"exit {cell['extra'].get('exit')}"
            if mode in RATIO_TARGETS and ratio is not None:
                target = RATIO_TARGETS[mode]
                note = f"{'PASS' if ratio <= target else 'FAIL'} (<= {target:g}x)  " + note
            print(
                f"{mode:<12}{n:>9}{cell['runs']:>5}{fmt_seconds(cell['seconds']):>10}"
                f"{('-' if ratio is None else f'{ratio:.2f}'):>9}{fmt_mb(cell['maxrss_kb']):>12}"
                f"{('-' if rss_ratio is None else f'{rss_ratio:.2f}'):>8}{fmt_mb(cell['rss_after_import_kb']):>10}"
                f"{fmt_mb(growth):>10}{('-' if growth_ratio is None else f'{growth_ratio:.1f}'):>8}  {note}"
            )
    print(
        "  median s: inside the child, load to save (imports excluded); x floor: over load + save; peak RSS: the child's\n"
        "  VmHWM (imports included); import MB: resident after imports, before the load; growth: peak - import; x load:\n"
        "  over the same figure for onnx.load alone"
    )
    print()
    print("log-log slope of median time against updates (first to last size measured; per step in brackets):")
    for mode in args.modes:
        points = [(n, results[mode][n]["seconds"]) for n in sizes if n in results[mode]]
        s = slope(points)
        steps = [slope(points[i : i + 2]) for i in range(len(points) - 1)]
        span = f"{points[0][0]}..{points[-1][0]}" if len(points) >= 2 else "-"
        print(f"  {mode:<12}{('-' if s is None else f'{s:.2f}'):>6}  over {span}  [{', '.join(f'{x:.2f}' for x in steps)}]")
    if "verify" in results and "no-verify" in results:
        print("\nverification cost (verify - no-verify) against the floor:")
        for n in sizes:
            if n in results["verify"] and n in results["no-verify"] and n in floor:
                extra = results["verify"][n]["seconds"] - results["no-verify"][n]["seconds"]
                print(f"  {n:>7}: +{extra:.3f} s = {extra / floor[n]['seconds']:.2f} x floor (target <= 1)")

    # ---- targets -----------------------------------------------------------------------------------
    print("\ntargets for `optimize --no-verify` (issue 7): <= 3x floor at 10k and 50k, slope <= 1.1, peak RSS <= 2x onnx.load's; verify adds <= 1 floor")
    nv = results.get("no-verify", {})
    verdicts = []
    for n in sizes:
        if n >= 10000 and n in nv and n in floor:
            r = nv[n]["seconds"] / floor[n]["seconds"]
            verdicts.append((f"time {n}", r <= TARGETS["ratio"], f"{r:.2f}x floor"))
        elif n >= 10000 and "no-verify" in results:
            verdicts.append((f"time {n}", False, skipped["no-verify"].get(n, "not measured")))
        if n in nv and n in load:
            r = nv[n]["maxrss_kb"] / load[n]["maxrss_kb"]
            verdicts.append((f"RSS {n}", r <= TARGETS["rss"], f"{r:.2f}x onnx.load's"))
    s = slope([(n, nv[n]["seconds"]) for n in sizes if n in nv])
    if s is not None:
        verdicts.append(("slope", s <= TARGETS["slope"] and max(nv) == sizes[-1], f"{s:.2f} over {min(nv)}..{max(nv)}"))
    ver = results.get("verify", {})
    for n in sizes:
        if n in ver and n in nv and n in floor:
            extra = (ver[n]["seconds"] - nv[n]["seconds"]) / floor[n]["seconds"]
            verdicts.append((f"verify cost {n}", extra <= 1.0, f"{extra:.2f} floors"))
    for name, ok, text in verdicts:
        print(f"  {'MET ' if ok else 'MISS'} {name}: {text}")

    print("\ntargets of issue 12 (time as a multiple of the floor measured in the same run, at 10k and 50k):")
    print(f"  {'command':<12}{'updates':>9}{'x floor':>9}{'target':>8}  verdict   (CPU x floor: the same on CPU time)")
    for mode, target in RATIO_TARGETS.items():
        for n in sizes:
            if n < 10000 or mode not in results:
                continue
            cell, base = results[mode].get(n), floor.get(n)
            if cell is None or base is None:
                print(f"  {mode:<12}{n:>9}{'-':>9}{target:>7g}x  FAIL ({skipped[mode].get(n, 'not measured')})")
                continue
            ratio = cell["seconds"] / base["seconds"]
            failed = cell["extra"].get("exit") not in (None, 0) or cell["extra"].get("verification_passed") is False
            verdict = "PASS" if ratio <= target and not failed else "FAIL"
            cpu_ratio = cell["cpu_seconds"] / base["cpu_seconds"] if base.get("cpu_seconds") else None
            cpu = "" if cpu_ratio is None else f"   (CPU {cpu_ratio:.2f}x)"
            print(f"  {mode:<12}{n:>9}{ratio:>9.2f}{target:>7g}x  {verdict}" + ("  (the command failed)" if failed else "") + cpu)
    for mode in ("no-verify", "verify"):
        for n in sizes:
            if n >= 10000 and n in results.get(mode, {}) and n in load:
                r = results[mode][n]["maxrss_kb"] / load[n]["maxrss_kb"]
                print(f"  {'RSS ' + mode:<12}{n:>9}{r:>9.2f}{2:>7g}x  {'PASS' if r <= 2 else 'FAIL'} (peak RSS against onnx.load's)")

    # ---- fusion checks -----------------------------------------------------------------------------
    print("\nfusion check against the generator's manifest:")
    for n in sizes:
        for mode in ("no-verify", "verify"):
            check = checks.get(n, {}).get(mode)
            if check is None:
                continue
            if "error" in check:
                print(f"  {n:>7} {mode}: check failed: {check['error']}")
                continue
            report = checks[n][mode + "_report"]
            ok = check["sgd_nodes"] == check["expected"] and not check["not_fused"] and not check["wrong_wiring"] and not check["unrelated_changed"] and check["outputs_kept"]
            print(
                f"  {n:>7} {mode}: {'OK' if ok else 'PROBLEM'}: SGD nodes {check['sgd_nodes']} / expected {check['expected']}; "
                f"unrelated nodes changed {len(check['unrelated_changed'])} / {check['unrelated']}; graph outputs kept {check['outputs_kept']}; "
                f"refused {report.get('refused_reasons')}"
            )
            for form, outputs in sorted(check["not_fused"].items()):
                reasons = {}
                for candidate, reason, detail in report.get("refused") or []:
                    if candidate in outputs:
                        reasons.setdefault(reason, detail)
                print(f"      not fused: {form} x{len(outputs)} (e.g. {outputs[0]}): " + "; ".join(f"{r}: {d}" for r, d in reasons.items()))
            if check["wrong_wiring"]:
                print(f"      wired to the wrong state: {check['wrong_wiring'][:5]}")
            if check["unrelated_changed"]:
                print(f"      unrelated nodes changed or removed: {check['unrelated_changed'][:10]}")
    if checks:
        first = checks[min(checks)]
        forms = next(iter(v for k, v in first.items() if not k.endswith("_report") and "forms" in v), {}).get("forms")
        if forms:
            print(f"  forms in the {min(checks)} file: " + ", ".join(f"{k} {v}" for k, v in forms.items()))

    # ---- profile -----------------------------------------------------------------------------------
    profiles = {}
    for n in args.profile or []:
        path = paths.get(n)
        if path is None:
            subprocess.run([sys.executable, os.path.join(HERE, "generate.py"), args.dir, "--sizes", str(n), "--seed", str(args.seed)], check=True)
            path = os.path.join(args.dir, f"sgd_bench_{n}.onnx")
        result, _, _, error = run_child(["--worker", "profile", path, str(args.profile_budget), str(args.profile_top)], args.profile_budget + args.timeout)
        print(f"\n== cProfile of sgdfuse.optimize(verify=False) + save on {n} updates", end="")
        if result is None:
            print(f": failed: {error}")
            continue
        print(f" ({result['seconds']:.1f} s{'' if result['complete'] else f', PARTIAL: stopped after the {args.profile_budget:.0f} s budget'})")
        print(result["text"])
        profiles[n] = result

    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"results": {m: {str(n): c for n, c in r.items()} for m, r in results.items()}, "skipped": skipped, "checks": {str(n): c for n, c in checks.items()}, "profiles": {str(n): p for n, p in profiles.items()}}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

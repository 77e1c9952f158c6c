"""The matcher of the work tree against a git revision's, in one process (issue 12).

The machine running benchmarks is seldom idle, and two processes a minute apart see different machines; so
this loads the revision's ``sgdfuse/passes/classes.py`` and ``sgdfuse/passes/sgd_match.py`` beside the work
tree's (the other modules are the work tree's, so the revision must not differ in them) and times both in one
process, alternating, as CPU time (``time.process_time``), keeping the least of the runs:

  matching    ``find_updates`` on a freshly built index (the index is built outside the timing); also shown
              without the time spent solving the classes' first members (``classes._solve_cluster``, the
              algebra, which both sides share), which is what the classes cost
  no-verify   ``sgdfuse.optimize(path, verify=False)`` + ``save`` (what ``sgdfuse optimize --no-verify`` does),
              with ``sgdfuse.api.find_updates`` set to the revision's or the work tree's

Both sides must give the same result: the same matches (every field, equations and nodes included) and
misses, and, for ``no-verify``, the same bytes written. Python's cyclic collector is paused, as
``optimize`` pauses it.

Usage (from the repository root):
    python bench/matching_ab.py /tmp/perf-bench/sgd_bench_10000.onnx [--rev main] [--runs 5] [--stages matching no-verify]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import subprocess
import sys
import tempfile
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import onnx  # noqa: E402

import sgdfuse.api as api  # noqa: E402
from sgdfuse.passes import classes, sgd_match  # noqa: E402
from sgdfuse.passes.index import build_index  # noqa: E402
from sgdfuse.passes.linear import Normaliser  # noqa: E402


class Solving:
    """CPU time spent in a ``classes`` module's ``_solve_cluster`` (the algebra on the classes' first members)."""

    def __init__(self, module: types.ModuleType) -> None:
        self.seconds = 0.0
        solve = module._solve_cluster

        def timed(*args):
            start = time.process_time()
            try:
                return solve(*args)
            finally:
                self.seconds += time.process_time() - start

        module._solve_cluster = timed


def revision_matcher(rev: str) -> types.ModuleType:
    """The revision's ``sgd_match`` module, reading the revision's ``classes`` (both loaded from ``git show``)."""
    def source(path: str) -> str:
        return subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{path}"], check=True, capture_output=True, text=True).stdout

    def load(name: str, text: str) -> types.ModuleType:
        module = types.ModuleType(name)
        module.__file__ = f"{rev}:{name}"
        sys.modules[name] = module  # dataclasses look their module up
        exec(compile(text, module.__file__, "exec"), module.__dict__)
        return module

    load("_revision_classes", source("sgdfuse/passes/classes.py"))
    text = source("sgdfuse/passes/sgd_match.py")
    wiring = "from sgdfuse.passes.classes import find_by_class"
    if wiring not in text:
        raise SystemExit(f"{rev}: sgd_match does not import find_by_class as expected")
    return load("_revision_sgd_match", text.replace(wiring, "from _revision_classes import find_by_class"))


def plain(result: tuple[list, list]) -> tuple[list, list]:
    """A matcher result as comparable text: every field of every match and miss, equations written."""
    matches, misses = result

    def fields(item) -> str:
        values = {f.name: getattr(item, f.name) for f in dataclasses.fields(item)}
        for name in ("parameter_equation", "accum_equation", "equation"):
            if name in values:
                values[name] = str(values[name])
        if "nodes" in values:
            values["nodes"] = sorted(values["nodes"])
        return repr(values) + repr(getattr(item, "structural_class", None))

    return [fields(m) for m in matches], [fields(m) for m in misses]


def time_matching(model: onnx.ModelProto, find_updates, solving: Solving) -> tuple[float, float, tuple]:
    """(CPU seconds of ``find_updates``, of them outside solving, the result)."""
    index = build_index(model)
    solving.seconds = 0.0
    start = time.process_time()
    result = find_updates(index, Normaliser(index))
    elapsed = time.process_time() - start
    return elapsed, elapsed - solving.seconds, plain(result)


def time_no_verify(path: str, find_updates, out: str) -> tuple[float, bytes]:
    api.find_updates = find_updates
    try:
        start = time.process_time()
        api.optimize(path, verify=False).save(out)
        elapsed = time.process_time() - start
    finally:
        api.find_updates = sgd_match.find_updates
    with open(out, "rb") as written:
        return elapsed, written.read()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--rev", default="main", help="the revision to compare with (default: main)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--stages", nargs="+", default=["matching", "no-verify"], choices=["matching", "no-verify"])
    args = parser.parse_args(argv)
    revision = revision_matcher(args.rev)
    sides = {args.rev: revision.find_updates, "work tree": sgd_match.find_updates}
    solving = {args.rev: Solving(sys.modules["_revision_classes"]), "work tree": Solving(classes)}
    gc.disable()
    with tempfile.TemporaryDirectory() as scratch:
        for path in args.files:
            model = onnx.load(path) if "matching" in args.stages else None
            for stage in args.stages:
                best = dict.fromkeys(sides, float("inf"))
                best_unsolved = dict.fromkeys(sides, float("inf"))
                results: dict[str, object] = {}
                for _ in range(args.runs):
                    for name, find_updates in sides.items():
                        if stage == "matching":
                            elapsed, unsolved, result = time_matching(model, find_updates, solving[name])
                            best_unsolved[name] = min(best_unsolved[name], unsolved)
                        else:
                            elapsed, result = time_no_verify(path, find_updates, os.path.join(scratch, "out.onnx"))
                        best[name] = min(best[name], elapsed)
                        if results.setdefault(name, result) != result:
                            raise SystemExit(f"{path}: {name} gave another {stage} result on another run")
                        gc.collect()
                same = len({repr(r) for r in results.values()}) == 1
                old, new = best.values()
                print(f"{os.path.basename(path)}  {stage:9s}  {args.rev} {old:.3f} s  work tree {new:.3f} s  "
                      f"({old / new:.2f}x, min of {args.runs})  results {'identical' if same else 'DIFFER'}", flush=True)
                if stage == "matching":
                    old, new = best_unsolved.values()
                    print(f"{os.path.basename(path)}  {'  but solving':9s}  {args.rev} {old:.3f} s  work tree {new:.3f} s  ({old / new:.2f}x)", flush=True)
                if not same:
                    return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

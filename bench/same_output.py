"""Do two sgdfuse source trees write the same files? (issue 12: a faster stage must not change a byte)

Runs ``sgdfuse optimize -o OUT --report REPORT`` (with ``--no-verify``, and for models up to
``--verify-max-bytes`` with verification as well) on every model given, once with the package of each tree,
and compares the output model, the JSON report, the exit code and the console text (with the output
directory replaced by a placeholder) byte for byte. Each tree runs in one child process of its own (its
directory first on ``PYTHONPATH``), which calls the CLI's entry point in-process for every model.

    git worktree add --detach /tmp/base main
    python bench/same_output.py --base /tmp/base --new . testdata /tmp/perf-bench/sgd_bench_10000.onnx

Arguments are model files or directories (searched for ``*.onnx``). Exit 0 when every file agrees.

With ``--check``, ``sgdfuse check MODEL FUSED --steps 3`` is compared instead (exit code and console text), FUSED
being the base tree's ``sgdfuse optimize MODEL --no-verify`` output, made first (a model it refuses to write is
left out and counted):

    python bench/same_output.py --check --base /tmp/base --new . testdata /tmp/cf-bench/sgd_bench_10000.onnx
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def _child(tree: str, jobs_file: str, out_dir: str) -> None:
    """Run every job of ``jobs_file`` with the sgdfuse of ``tree`` (already first on sys.path)."""
    import sgdfuse
    from sgdfuse import cli

    if not os.path.realpath(sgdfuse.__file__).startswith(os.path.realpath(tree) + os.sep):
        raise SystemExit(f"sgdfuse imported from {sgdfuse.__file__}, not from {tree}")
    results = {}
    for job in json.loads(Path(jobs_file).read_text()):
        name = job["name"]
        if "argv" in job:
            argv = job["argv"]
        else:
            model, flags = job["model"], job["flags"]
            argv = ["optimize", model, "-o", os.path.join(out_dir, f"{name}.onnx"), "--report", os.path.join(out_dir, f"{name}.json"), "-q", *flags]
        out, err = io.StringIO(), io.StringIO()
        code = 0
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                cli.main(argv)
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) else 1
        results[name] = {"code": code, "stdout": out.getvalue().replace(out_dir, "<OUT>"), "stderr": err.getvalue().replace(out_dir, "<OUT>")}
    Path(out_dir, "results.json").write_text(json.dumps(results, indent=1, sort_keys=True))


def _models(paths: list[str]) -> list[Path]:
    found: list[Path] = []
    for path in map(Path, paths):
        found.extend(sorted(path.rglob("*.onnx")) if path.is_dir() else [path])
    return found


def _run(tree: str, jobs_file: str, out_dir: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), COLUMNS="160")
    subprocess.run([sys.executable, os.path.abspath(__file__), "--child", tree, jobs_file, out_dir], env=env, check=True)
    return json.loads(Path(out_dir, "results.json").read_text())


def _compare_checks(args) -> int:
    """``--check``: fuse every model with the base tree, then run ``sgdfuse check`` with both trees."""
    models = _models(args.models)
    with contextlib.ExitStack() as stack:
        root = args.keep or stack.enter_context(tempfile.TemporaryDirectory(prefix="sgdfuse-same-check-"))
        fused_dir = os.path.join(root, "fused")
        os.makedirs(fused_dir, exist_ok=True)
        jobs_file = os.path.join(root, "optimize.json")
        Path(jobs_file).write_text(json.dumps(
            [{"name": f"{k:03d}_{model.stem}", "model": str(model), "flags": ["--no-verify"]} for k, model in enumerate(models)]))
        _run(args.base, jobs_file, fused_dir)
        jobs = []
        for k, model in enumerate(models):
            fused = Path(fused_dir, f"{k:03d}_{model.stem}.onnx")
            if fused.exists():
                jobs.append({"name": f"{k:03d}_{model.stem}.check", "argv": ["check", str(model), str(fused), "--steps", "3"]})
        jobs_file = os.path.join(root, "check.json")
        Path(jobs_file).write_text(json.dumps(jobs))
        results = {}
        for side, tree in (("base", args.base), ("new", args.new)):
            os.makedirs(os.path.join(root, side), exist_ok=True)
            results[side] = _run(tree, jobs_file, os.path.join(root, side))
        differing = [job["name"] for job in jobs if results["base"][job["name"]] != results["new"][job["name"]]]
        codes = [results["base"][job["name"]]["code"] for job in jobs]
        print(f"{len(models)} models, {len(jobs)} fused by the base tree and checked; identical exit code and console text: "
              f"{len(jobs) - len(differing)} (exit 0: {codes.count(0)}, exit 1: {codes.count(1)}, other: {len(codes) - codes.count(0) - codes.count(1)})")
        for name in differing:
            print("DIFFERS:", name)
        return 1 if differing else 0


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(*sys.argv[2:5])
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", help="model files or directories of them")
    parser.add_argument("--base", required=True, help="source tree holding the reference sgdfuse package")
    parser.add_argument("--new", required=True, help="source tree holding the sgdfuse package under test")
    parser.add_argument("--verify-max-bytes", type=int, default=1 << 20, help="also run with verification for models up to this size")
    parser.add_argument("--keep", help="write the outputs under this directory (default: a temporary one, removed)")
    parser.add_argument("--check", action="store_true", help="compare sgdfuse check on each model and the base tree's fused form")
    args = parser.parse_args()
    if args.check:
        return _compare_checks(args)

    jobs = []
    for k, model in enumerate(_models(args.models)):
        stem = f"{k:03d}_{model.stem}"
        jobs.append({"name": f"{stem}.noverify", "model": str(model), "flags": ["--no-verify"]})
        if model.stat().st_size <= args.verify_max_bytes:
            jobs.append({"name": f"{stem}.verify", "model": str(model), "flags": []})
    with contextlib.ExitStack() as stack:
        root = args.keep or stack.enter_context(tempfile.TemporaryDirectory(prefix="sgdfuse-same-"))
        os.makedirs(root, exist_ok=True)
        jobs_file = os.path.join(root, "jobs.json")
        Path(jobs_file).write_text(json.dumps(jobs))
        dirs = {side: os.path.join(root, side) for side in ("base", "new")}
        results = {}
        for side, tree in (("base", args.base), ("new", args.new)):
            os.makedirs(dirs[side], exist_ok=True)
            results[side] = _run(tree, jobs_file, dirs[side])
        differing = []
        counts = {"models": 0, "reports": 0, "console": 0, "absent in both": 0}
        for job in jobs:
            name = job["name"]
            base, new = results["base"][name], results["new"][name]
            if base != new:
                differing.append(f"{name}: exit code or console text differs")
            else:
                counts["console"] += 1
            for suffix, kind in ((".onnx", "models"), (".json", "reports")):
                a, b = Path(dirs["base"], name + suffix), Path(dirs["new"], name + suffix)
                if a.exists() != b.exists():
                    differing.append(f"{name}{suffix}: written by one side only")
                elif not a.exists():
                    counts["absent in both"] += 1
                elif a.read_bytes() != b.read_bytes():
                    differing.append(f"{name}{suffix}: bytes differ")
                else:
                    counts[kind] += 1
        print(f"{len(jobs)} runs of {len(_models(args.models))} models; identical: {counts['models']} models, {counts['reports']} reports, "
              f"{counts['console']} exit codes and console texts; {counts['absent in both']} files written by neither side (an error)")
        for line in differing:
            print("DIFFERS:", line)
        return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())

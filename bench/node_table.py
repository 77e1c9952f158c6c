"""How long does reading the node table take: natively from the file's bytes, natively re-serialising, and
through protobuf's Python API (sgdfuse.passes.scan; issue 12)?

Usage:
    python bench/node_table.py FILE.onnx [FILE.onnx ...] [--runs 5]

Each reader runs ``--runs`` times in this process; the best and the median wall time are printed. The table
of each run is kept until its clock stops (freeing it is not part of reading it). The first native call
builds or loads the scanner before timing starts.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import onnx

from sgdfuse.passes import scan


def _times(read, runs: int) -> tuple[float, float]:
    seconds = []
    for _ in range(runs):
        gc.collect()
        start = time.perf_counter()
        table = read()
        seconds.append(time.perf_counter() - start)
        del table
    return min(seconds), statistics.median(seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    build = scan.build_scanner()
    print(f"scanner: {build.path} ({'cached' if build.cached else f'built in {build.seconds:.1f} s'})")
    for path in args.files:
        with open(path, "rb") as handle:
            data = handle.read()
        model = onnx.load_model_from_string(data)
        assert scan.native_node_table(data) == scan.python_node_table(model)
        print(f"{path}: {len(model.graph.node)} nodes")
        for name, read in [
            ("native, from the file's bytes", lambda: scan.node_table(model, data)),
            ("native, graph serialised again", lambda: scan.node_table(model)),
            ("graph.SerializeToString() alone", lambda: model.graph.SerializeToString()),
            ("protobuf's Python API", lambda: scan.python_node_table(model)),
        ]:
            best, median = _times(read, args.runs)
            print(f"  {name:34s} best {best * 1000:8.1f} ms   median {median * 1000:8.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The lowered graphs are kept as canonical bytes until something reads them as messages.

``sgdfuse.lower`` returns a :class:`GEModel` whose step and init ``ModelDef`` s are serialised by sgdfuse's
own encoder and parsed only when read (a parsed 10,000-update step graph takes about 280 MB). What is written
must still be what protobuf's deterministic serialisation of the parsed messages writes (the reference:
``ModelDef.SerializeToString(deterministic=True)``), and a model read, edited and saved must save the edit.
"""

from __future__ import annotations

import pytest

import sgdfuse
from sgdfuse.lowering import ge_ir
from test_lowering_support import MODEL_PATHS, fused

SAMPLE = MODEL_PATHS[::6]


def _canonical(data: bytes) -> bytes:
    message = ge_ir.ModelDef()
    message.ParseFromString(data)
    return message.SerializeToString(deterministic=True)


@pytest.mark.parametrize("path", SAMPLE, ids=[p.stem for p in SAMPLE])
def test_unparsed_graphs_are_written_as_protobuf_writes_them_parsed(path):
    lowered = sgdfuse.lower(fused(path), soc="Ascend910B2")
    step, init = lowered.to_bytes(), lowered.init_bytes()
    assert step == _canonical(step)
    assert init == _canonical(init)
    count = lowered.op_count()  # counted in the bytes
    assert lowered.graph.op[-1].type == "NetOutput"  # parses the step graph
    assert count == len(lowered.graph.op)
    assert lowered.to_bytes() == step and lowered.init_bytes() == init  # parsed, then serialised: the same bytes
    assert lowered.model.attr["soc_version"].s == b"Ascend910B2"
    assert lowered.init_model.attr["soc_version"].s == b"Ascend910B2"


def test_an_edit_of_the_parsed_model_is_what_is_saved(tmp_path):
    lowered = sgdfuse.lower(fused(MODEL_PATHS[0]), soc="Ascend910B2")
    lowered.graph.op[0].attr["sgdfuse_test"].i = 7
    lowered.init_model.graph[0].op[0].attr["sgdfuse_test"].i = 8
    lowered.save_air(tmp_path / "m.air")
    lowered.save_init_air(tmp_path / "m.init.air")
    saved = ge_ir.ModelDef.FromString((tmp_path / "m.air").read_bytes())
    saved_init = ge_ir.ModelDef.FromString((tmp_path / "m.init.air").read_bytes())
    assert saved.graph[0].op[0].attr["sgdfuse_test"].i == 7
    assert saved_init.graph[0].op[0].attr["sgdfuse_test"].i == 8

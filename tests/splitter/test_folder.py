"""A split saved as source and safetensors and read back: the same slices, bit for bit, for the
eight tiny architectures; tied weights stay one tensor; bad folders are SplitErrors."""
import json

import pytest
import torch
from safetensors import safe_open

from lamina.splitter import SplitModel, split_model
from lamina.splitter.errors import SplitError
from lamina.splitter.folder import WEIGHTS
from lamina.splitter.reference import ReferenceKV

from tiny_models import ARCHS, tiny_model

IDS = torch.tensor([5, 17, 3, 60, 41, 9, 22])


def _logits(sm: SplitModel) -> torch.Tensor:
    pos = torch.arange(len(IDS))
    kv = ReferenceKV()
    return sm.forward(IDS, pos, torch.tensor([2, len(IDS) - 1]),
                      lambda l, q, k, v: kv.attend(0, l, q, k, v, pos, sm.specs[l]))


def _attr(gm, target: str):
    for part in target.split("."):
        gm = getattr(gm, part)
    return gm


@pytest.mark.parametrize("arch", ARCHS)
def test_read_back_runs_the_same_slices(arch, tmp_path):
    sm = split_model(tiny_model(arch))
    back = SplitModel.load(sm.save(tmp_path / "s"))
    assert back.program is None and back.graph is None
    assert [i.inputs for i in back.infos] == [i.inputs for i in sm.infos]
    assert [i.outputs for i in back.infos] == [i.outputs for i in sm.infos]
    assert back.specs == sm.specs and back.partition.contexts == sm.partition.contexts
    assert [len(s.graph.nodes) for s in back.slices] == [len(s.graph.nodes) for s in sm.slices]
    assert torch.equal(_logits(back), _logits(sm))
    assert (tmp_path / "s" / "slices" / "slice_0.py").read_text().lstrip().startswith("def forward")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_16_bit_split_reads_back(arch, tmp_path):
    """In bfloat16 the rotary table's buffer is cast by an op that reads no input: tracing back
    must keep it an op on the buffer (a folded constant would name no saved tensor)."""
    sm = split_model(tiny_model(arch).to(torch.bfloat16))
    back = SplitModel.load(sm.save(tmp_path / "s"))
    for gm in back.slices:
        assert not any(n.op == "get_attr" and "_tensor_constant" in n.target
                       for n in gm.graph.nodes)
    assert torch.equal(_logits(back), _logits(sm))


def test_tied_weights_are_stored_once_and_stay_tied(tmp_path):
    model = tiny_model("llama")
    model.lm_head.weight = model.model.embed_tokens.weight  # tie them
    sm = split_model(model)
    back = SplitModel.load(sm.save(tmp_path / "s"))
    with safe_open(str(tmp_path / "s" / WEIGHTS), framework="pt") as f:
        n_stored = len(list(f.keys()))
    read = {_attr(s, n.target).data_ptr() for s in sm.slices for n in s.graph.nodes
            if n.op == "get_attr"}
    assert n_stored == len(read)  # one entry per distinct tensor the slices read
    first = {p.data_ptr() for p in back.slices[0].parameters()}
    last = {p.data_ptr() for p in back.slices[-1].parameters()}
    assert first & last  # the embedding is the head: one tensor in memory after the read


def test_folders_that_cannot_be_read_are_split_errors(tmp_path):
    sm = split_model(tiny_model("gpt2"))
    folder = sm.save(tmp_path / "s")
    meta = json.loads((folder / "split.json").read_text())

    (folder / "split.json").write_text(json.dumps({**meta, "format": 1}))
    with pytest.raises(SplitError, match="format 1"):
        SplitModel.load(folder)
    (folder / "split.json").write_text(json.dumps(meta))

    src = (folder / "slices" / "slice_1.py").read_text()
    (folder / "slices" / "slice_1.py").write_text(src.replace("def forward", "def forwad"))
    with pytest.raises(SplitError, match="slice_1.py"):
        SplitModel.load(folder)
    (folder / "slices" / "slice_1.py").write_text(src)

    (folder / WEIGHTS).write_bytes(b"truncated")
    with pytest.raises(SplitError, match=WEIGHTS):
        SplitModel.load(folder)


def test_a_global_that_cannot_be_imported_back_is_refused_at_save(tmp_path):
    sm = split_model(tiny_model("llama"))
    gm = sm.slices[0]
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):
        gm.graph.call_function(lambda x: x, (out.args[0][0],))  # a lambda in the code
    gm.recompile()
    with pytest.raises(SplitError, match="cannot be imported back"):
        sm.save(tmp_path / "s")

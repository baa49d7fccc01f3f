"""The SDPA fallback path for plain PyTorch modules, and the splitter's errors."""
import pytest
import torch

from lamina.splitter import SplitError, split_model

from plain_models import NoAttention, TinySDPALM, make_sdpa_lm


def test_plain_sdpa_module_is_split_by_the_fallback_path():
    model = make_sdpa_lm()
    sm = split_model(model)
    assert len(sm.specs) == 2 and len(sm.slices) == 3
    assert sm.specs[0].num_heads == 4 and sm.specs[0].num_kv_heads == 2
    assert sm.specs[0].scale == pytest.approx(8 ** -0.5)
    r = sm.verify(seqs=[[1, 2, 3, 4, 5], [9, 8, 7, 6, 5, 4, 3, 2, 1], [5, 5, 5, 5]])
    assert r.prompt_diff < 1e-5 and r.continuation_diff < 1e-5
    # the residual stream (d=32, float32) is the context at every boundary
    assert [i.context_bytes for i in sm.infos[:-1]] == [128.0, 128.0]


def test_model_without_attention_is_rejected():
    with pytest.raises(SplitError, match="no attention"):
        split_model(NoAttention().eval())


def test_masked_sdpa_is_rejected_naming_the_node():
    torch.manual_seed(0)
    with pytest.raises(SplitError, match=r"node 'scaled_dot_product_attention.*attn_mask"):
        split_model(TinySDPALM(mask=True).eval())


def test_non_causal_sdpa_is_rejected_naming_the_node():
    torch.manual_seed(0)
    with pytest.raises(SplitError, match=r"node 'scaled_dot_product_attention.*non-causal"):
        split_model(TinySDPALM(causal=False).eval())


class ParallelAttention(torch.nn.Module):
    """Two attentions over the same input, summed: not a chain of slices."""

    def __init__(self):
        super().__init__()
        self.e = torch.nn.Embedding(32, 16)
        self.a = torch.nn.Linear(16, 48)
        self.b = torch.nn.Linear(16, 48)

    def _attn(self, proj, x):
        T = x.shape[1]
        q, k, v = proj(x).view(1, T, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    def forward(self, input_ids, position_ids):
        x = self.e(input_ids)
        return self._attn(self.a, x) + self._attn(self.b, x)


def test_parallel_attentions_cannot_be_expressed():
    with pytest.raises(SplitError, match="do not depend on each other"):
        split_model(ParallelAttention().eval())

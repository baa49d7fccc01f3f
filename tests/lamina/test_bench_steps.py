"""The step-at-a-time decoders of the interleaved e2e benchmark decode what HF generate does."""
import os
import sys

import pytest
import torch

from lamina import LLM
from lamina.benchmark.steps import HFStepper, LaminaStepper

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "e2e"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "splitter"))
from hf_oracle import tiny_case  # noqa: E402
from tiny_models import tiny_model  # noqa: E402

PROMPTS = [[(5 * i + 3 * j) % 90 + 3 for j in range(n)] for i, n in enumerate((4, 11, 1, 7))]
STEPS = 5


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return tiny_case("llama", tmp_path_factory, PROMPTS, STEPS + 1)


def test_hf_stepper_matches_generate_on_the_padded_batch():
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    stepper = HFStepper(model, PROMPTS, pad_id=0)
    got = [stepper.tokens]
    for _ in range(STEPS):
        stepper.step()
        got.append(stepper.tokens)
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    with torch.no_grad():
        want = model.generate(ids, attention_mask=(torch.arange(width) >= width - torch.tensor(
            [len(p) for p in PROMPTS])[:, None]).long(), do_sample=False,
            max_new_tokens=STEPS + 1, pad_token_id=0)[:, width:]
    assert torch.equal(torch.cat(got, dim=1), want)
    assert stepper.mask.shape == (len(PROMPTS), width + STEPS)


def test_lamina_stepper_decodes_one_token_per_request_per_step(case):
    folder, want = case
    with LLM(str(folder), memory=2, placement="inproc") as llm:
        stepper = LaminaStepper(llm, PROMPTS, STEPS)
        for _ in range(STEPS):
            stepper.step()
        assert [r.output_ids for r in stepper.reqs] == want
        assert all(r.finished for r in stepper.reqs)  # sized so that the last step ends them
        assert not llm.deployment.has_work()

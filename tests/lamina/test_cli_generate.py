"""``lamina generate`` on the builtin model with the compute replica and memory nodes as separate
processes."""
import pytest

from lamina.cli import main


@pytest.mark.slow
def test_generate_smollm2_over_shm(capsys):
    rc = main(["generate", "--model", "smollm2", "--memory", "2", "--placement", "procs",
               "--transport", "shm",
               "--prompt", "The capital of France is", "--max-tokens", "6"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "### The capital of France is\n Paris" in out and "[6 tokens, finish: length]" in out


def test_generate_rejects_bad_sampling_args(capsys):
    assert main(["generate", "--model", "smollm2", "--top-p", "0"]) == 2
    assert "top_p" in capsys.readouterr().err

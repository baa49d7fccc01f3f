"""``lamina split`` on a plain module factory (package.module:function) and on a bad path."""
import os
import sys

from lamina.cli import main

HERE = os.path.dirname(__file__)


def test_split_factory_check_out_draw(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(HERE, "..", "splitter"))
    png = tmp_path / "cut.png"
    rc = main(["split", "plain_models:make_sdpa_lm", "--check", "--out", str(tmp_path / "s"),
               "--draw", str(png)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "context B/tok" in out and "q/k/v B/tok" in out
    lines = [l for l in out.splitlines() if l[:1].isdigit() and "slices," not in l]
    assert len(lines) == 3  # two attentions -> three slices
    assert "max |diff|" in out
    diff = float(out.split("max |diff| = ")[1].split()[0])
    assert diff < 1e-5
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "s" / "weights.safetensors").is_file() and (tmp_path / "s" / "split.json").is_file()


def test_split_bad_path_is_a_clear_error(tmp_path, capsys):
    rc = main(["split", str(tmp_path / "missing-model")])
    err = capsys.readouterr().err
    assert rc == 2 and "missing-model" in err and "does not exist" in err

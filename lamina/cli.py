"""The ``lamina`` command line: ``lamina split|...`` (more subcommands join as they land)."""
from __future__ import annotations

import argparse
import sys


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda r: "  ".join(str(x).ljust(w) for x, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _short(names: list[str], limit: int = 48) -> str:
    s = ", ".join(names)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def cmd_split(args: argparse.Namespace) -> int:
    from lamina.models import ModelLoadError, load_model
    from lamina.splitter import SplitError, split_model

    try:
        loaded = load_model(args.model, device=args.device)
        sm = split_model(loaded.model)
    except (ModelLoadError, SplitError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = []
    for info in sm.infos:
        rows.append([info.index, info.num_ops, _short(info.inputs), _short(info.outputs),
                     f"{info.context_bytes:.0f}", f"{info.qkv_bytes:.0f}"])
    print(_table(rows, ["slice", "ops", "inputs", "outputs", "context B/tok", "q/k/v B/tok"]))
    spec = sm.specs[0]
    print(f"\n{len(sm.slices)} slices, {len(sm.specs)} attentions "
          f"(heads {spec.num_heads}, kv heads {spec.num_kv_heads}, head_dim {spec.head_dim}); "
          f"cut edges: " + "; ".join(f"{i}->{i + 1}: {', '.join(c)}"
                                       for i, c in enumerate(sm.partition.contexts[:3]))
          + (" ..." if len(sm.partition.contexts) > 3 else ""))
    if args.out:
        print(f"saved to {sm.save(args.out)}")
    if args.draw:
        from lamina.splitter.draw import draw_split
        print(f"drew the cuts to {draw_split(sm, args.draw)}")
    if args.check:
        r = sm.verify()
        print(f"check: slices chained through reference attention vs the original model on "
              f"{r.num_sequences} ragged sequences {r.lengths}: max |diff| = {r.max_abs_diff:.3g} "
              f"(prompts {r.prompt_diff:.3g}, continuation {r.continuation_diff:.3g})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lamina", description="LLM serving with attention offloading")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("split", help="cut a model at its attention operators")
    s.add_argument("model", help="HF folder, .gguf file, builtin alias (smollm2), or "
                                 "package.module:function returning an nn.Module")
    s.add_argument("--out", help="save the SplitModel to this folder")
    s.add_argument("--draw", metavar="FILE.png", help="render the graph with its cuts")
    s.add_argument("--check", action="store_true", help="verify against the original model")
    s.add_argument("--device", default="cpu")
    s.set_defaults(func=cmd_split)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

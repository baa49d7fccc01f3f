"""The ``lamina`` command line: ``lamina split|generate|launch|bench|plan``."""
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


def cmd_generate(args: argparse.Namespace) -> int:
    from lamina.cli_args import config_from_args
    from lamina.llm import LLM
    from lamina.models import ModelLoadError
    from lamina.types import SamplingParams

    try:
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                seed=args.seed, max_tokens=args.max_tokens)
        llm = LLM(config=config_from_args(args), trace=args.trace)
    except (ValueError, ModelLoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with llm:
        prompts = args.prompt or ["The capital of France is"]
        if args.chat:
            outs = [llm.chat([{"role": "user", "content": p}], params, use_tqdm=False)[0]
                    for p in prompts]
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            if out.error is not None:
                print(f"error: {out.error}", file=sys.stderr)
                continue
            c = out.outputs[0]
            print(f"### {prompt}\n{c.text}\n[{len(c.token_ids)} tokens, finish: {c.finish_reason}]")
    return 0 if all(o.error is None for o in outs) else 1


def build_parser() -> argparse.ArgumentParser:
    from lamina.cli_args import add_deployment_args

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

    g = sub.add_parser("generate", help="generate text with attention offloaded to memory nodes")
    g.add_argument("--prompt", action="append", help="repeat for a batch (default: a demo prompt)")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--trace", metavar="FILE.json", default=None,
                   help="write a Chrome/Perfetto timeline of the run")
    add_deployment_args(g, placement="procs")
    g.set_defaults(func=cmd_generate)

    from lamina.server.launch import add_parser as add_launch
    add_launch(sub)
    from lamina.benchmark.run import add_parser as add_bench
    add_bench(sub)
    from lamina.costmodel.plan_cli import add_parser as add_plan
    add_plan(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"] and "--plan" in argv:  # the planner has its own arguments
        from lamina.costmodel.planner import plan_main
        return plan_main([a for a in argv[1:] if a != "--plan"])
    if argv[:1] == ["plan"] and "--calibrate" in argv:  # measures this machine: its own arguments
        from lamina.benchmark.calibrate import main as calibrate_main
        return calibrate_main([a for a in argv[1:] if a != "--calibrate"])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

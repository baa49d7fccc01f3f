"""The ``lamina`` command line: ``lamina split|generate|launch|bench``."""
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
    from lamina.api import LLM
    from lamina.models import ModelLoadError
    from lamina.types import SamplingParams

    try:
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                seed=args.seed, max_tokens=args.max_tokens)
        llm = LLM(args.model, memory=args.memory, transport=args.transport, device=args.device,
                  kv_cache_gb=args.kv_cache_gb, **pipeline_kwargs(args))
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


def add_pipeline_args(p: argparse.ArgumentParser) -> None:
    """``--compute``, ``--compute-processes``, ``--micro-batches``, ``--pipeline``,
    ``--attn-parts``, ``--trace`` (see lamina.pipeline); :func:`pipeline_kwargs` turns them into ``LLM`` arguments."""
    p.add_argument("--compute", type=int, default=1,
                   help="compute replicas (in this process unless --compute-processes)")
    p.add_argument("--compute-processes", action="store_true",
                   help="run each compute replica in its own process (needs --transport shm): "
                        "nodes reply to the next replica, contexts move between processes")
    p.add_argument("--micro-batches", type=int, default=None,
                   help="micro-batches in flight (default: 1; compute+1 when rotational)")
    p.add_argument("--pipeline", default=None, choices=["none", "fixed", "rotational"],
                   help="staggered pipelining schedule (default: rotational when more than one "
                        "micro-batch or replica)")
    p.add_argument("--attn-parts", type=int, default=1,
                   help="send each memory node its share of a layer as up to this many "
                        "mini-batches, so it attends the first while the rest arrive")
    p.add_argument("--trace", metavar="FILE.json", default=None,
                   help="write a Chrome/Perfetto timeline of the run")


def pipeline_kwargs(args: argparse.Namespace) -> dict:
    return dict(compute=args.compute, micro_batches=args.micro_batches, pipeline=args.pipeline,
                attn_parts=args.attn_parts, trace=args.trace,
                compute_processes=args.compute_processes)


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

    g = sub.add_parser("generate", help="generate text with attention offloaded to memory nodes")
    g.add_argument("--model", default="smollm2")
    g.add_argument("--prompt", action="append", help="repeat for a batch (default: a demo prompt)")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--memory", type=int, default=1, help="memory nodes")
    g.add_argument("--transport", default="local", choices=["local", "shm"],
                   help="local: memory nodes in this process; shm: separate processes")
    g.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV budget per memory node")
    g.add_argument("--device", default="cpu")
    add_pipeline_args(g)
    g.set_defaults(func=cmd_generate)

    from lamina.launch import add_parser as add_launch
    add_launch(sub)
    from lamina.bench_cli import add_parser as add_bench
    add_bench(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"] and "--plan" in argv:  # the planner has its own arguments
        from lamina.planner import plan_main
        return plan_main([a for a in argv[1:] if a != "--plan"])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

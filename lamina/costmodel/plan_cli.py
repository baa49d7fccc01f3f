"""``lamina plan``: deployments a buyer can order, within every limit given, and why.

    lamina plan --model M --context L [--batch B] [--tbt-slo 50ms] [--ttft-slo 2s]
                [--max-devices N] [--devices-per-node 8] [--nodes K] [--nic 200Gbps]
                [--nic-latency 5us] [--nic-shared] [--budget-usd X] [--catalog FILE]
                [--json] [--top 5]

``--model``: HF folder (only its ``config.json`` is read), a ``config.json``, a ``.gguf``
(metadata only) or a builtin alias (smollm2, llama-13b/33b/65b); no weights are loaded.
``--context``: KV tokens per request (prompt + output); the TTFT estimate treats all of it
as prompt. Output: the best plan per (compute device, memory device) pair, cheapest per
million tokens first, plus the best homogeneous plan (``"homogeneous": true``) for the ratio.
See :mod:`lamina.costmodel.search` for the timing and money model (``usd``: device capex;
``usd_per_mtok``: capex amortised over 3 years of 24/7 decoding at the predicted rate).
Exit status: 0 with plans, 1 when no plan meets the constraints (message names the binding
one), 2 for bad arguments, models or catalogs.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from lamina.costmodel.constraints import Constraints, parse_bandwidth, parse_duration, parse_usd
from lamina.costmodel.hardware import CatalogError, load_catalog
from lamina.costmodel.model import DEFAULT, KV_ELEMENT_BYTES, ModelSpec, load_model_spec
from lamina.costmodel.search import Candidate, Outcome, binding_message, search

_GGUF_KEYS = {"layers": "block_count", "hidden": "embedding_length", "heads": "attention.head_count",
              "kv_heads": "attention.head_count_kv", "intermediate": "feed_forward_length"}


def spec_from_gguf(path: Path) -> ModelSpec:
    """Shapes from a GGUF file's metadata (``<arch>.block_count`` ...); BF16 serving assumed."""
    import gguf  # optional dependency, only for .gguf inputs

    r = gguf.GGUFReader(str(path))

    def val(key: str):
        f = r.fields.get(key)
        if f is None:
            return None
        v = f.parts[f.data[0]]
        return bytes(v).decode() if f.types and f.types[0] == gguf.GGUFValueType.STRING else int(v[0])

    arch = val("general.architecture") or "llama"
    got = {k: val(f"{arch}.{key}") for k, key in _GGUF_KEYS.items()}
    if got["layers"] is None or got["hidden"] is None or got["heads"] is None:
        raise ValueError(f"{path}: GGUF metadata lacks {arch}.block_count/embedding_length/attention.head_count")
    tokens = r.fields.get("tokenizer.ggml.tokens")
    vocab = val(f"{arch}.vocab_size") or (len(tokens.data) if tokens else None)
    if vocab is None:
        raise ValueError(f"{path}: GGUF metadata has no vocabulary size")
    hd = val(f"{arch}.attention.key_length") or got["hidden"] // got["heads"]
    return ModelSpec(path.stem, got["layers"], got["hidden"], got["heads"], got["kv_heads"] or got["heads"],
                     hd, got["intermediate"] or 4 * got["hidden"], vocab,
                     tie_embeddings="output.weight" not in {t.name for t in r.tensors})


def resolve_model(name: str) -> ModelSpec:
    """Any ``--model`` form to a :class:`ModelSpec` (shapes only)."""
    p = Path(name)
    if p.is_file() and p.suffix == ".gguf":
        return spec_from_gguf(p)
    return load_model_spec(name)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", required=True,
                    help="HF folder or config.json, .gguf, or alias (smollm2, llama-13b, ...)")
    ap.add_argument("--context", required=True, type=int, help="KV tokens per request")
    ap.add_argument("--kv-dtype", default="auto", choices=("auto", *KV_ELEMENT_BYTES),
                    help="KV format on every device: auto (the model's dtype), or 8 bits with a "
                         "scale per token and head (int8, fp8_e4m3), or bfloat16 keys with int8 "
                         "values (k16v8)")
    ap.add_argument("--batch", type=int, help="requests decoded per step (default: best)")
    ap.add_argument("--tbt-slo", type=parse_duration, help="time between tokens, e.g. 50ms")
    ap.add_argument("--ttft-slo", type=parse_duration, help="time to first token, e.g. 2s")
    ap.add_argument("--max-devices", type=int, help="compute + memory devices in total")
    ap.add_argument("--devices-per-node", type=int, default=8, help="accelerators per server (8)")
    ap.add_argument("--nodes", type=int, help="servers in total")
    ap.add_argument("--nic", type=parse_bandwidth, help="network per device, e.g. 200Gbps or 25GB/s "
                    "(default: each device's catalog nic_gbps)")
    ap.add_argument("--nic-latency", type=parse_duration, default=0.0, help="one-way, e.g. 5us")
    ap.add_argument("--nic-shared", action="store_true", help="--nic is one NIC per node, shared")
    ap.add_argument("--budget-usd", type=parse_usd, help="device capex limit, e.g. 250k")
    ap.add_argument("--catalog", action="append", default=[], metavar="FILE",
                    help="hardware YAML merged over the builtin configs/hardware.yaml (repeatable)")
    ap.add_argument("--json", action="store_true", help="machine-readable list of plans")
    ap.add_argument("--top", type=int, default=5, help="plans to show (plus the homogeneous baseline)")
    ap.add_argument("--calibrate", action="store_true",
                    help="instead: fit the model to this machine and check it against measured "
                         "`lamina bench` runs (see `lamina plan --calibrate --help`)")


def as_dict(p: Candidate, baseline: Candidate | None) -> dict:
    e = p.est
    d = {"homogeneous": p.homogeneous, "devices": p.devices(),
         "compute": {"kind": e.compute.name, "count": e.n_compute},
         "memory": {"kind": e.memory.name, "count": e.n_memory} if e.memory else None,
         "nodes": p.nodes, "batch": e.batch, "micro_batches": p.micro_batches, "pipeline": p.pipeline,
         "throughput_tok_s": round(p.throughput, 1), "tbt_ms": round(p.tbt * 1e3, 3),
         "ttft_ms": round(p.ttft * 1e3, 1),
         "interconnect_used_gb_s": round(p.net_used / 1e9, 3),
         "interconnect_available_gb_s": None if p.net_available == float("inf") else round(p.net_available / 1e9, 3),
         "usd": round(p.usd, 2), "usd_per_mtok": round(p.usd_per_mtok, 4), "bottleneck": p.bottleneck}
    if baseline is not None:
        d["vs_homogeneous"] = round(baseline.usd_per_mtok / p.usd_per_mtok, 3)
    return d


def format_table(model: ModelSpec, context: int, rows: list[Candidate], baseline: Candidate | None) -> str:
    head = ["#", "compute", "memory", "nodes", "batch", "mb/pipeline", "tok/s", "TBT ms", "TTFT ms",
            "net GB/s used/avail", "USD", "$/Mtok", "vs homo", "bottleneck"]
    body = []
    for i, p in enumerate(rows, 1):
        e = p.est
        avail = "local" if p.net_available == float("inf") else f"{p.net_available / 1e9:.0f}"
        body.append([str(i) + ("*" if p.homogeneous else ""), f"{e.n_compute} x {e.compute.name}",
                     f"{e.n_memory} x {e.memory.name}" if e.memory else "-", str(p.nodes), str(e.batch),
                     f"{p.micro_batches}/{p.pipeline}", f"{p.throughput:,.0f}", f"{p.tbt * 1e3:.1f}",
                     f"{p.ttft * 1e3:.0f}", f"{p.net_used / 1e9:.1f}/{avail}", f"{p.usd:,.0f}",
                     f"{p.usd_per_mtok:.4g}",
                     f"{baseline.usd_per_mtok / p.usd_per_mtok:.2f}x" if baseline else "n/a", p.bottleneck])
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    line = lambda r: "  ".join(x.rjust(w) if j in (0, 3, 4, 6, 7, 8, 10, 11, 12) else x.ljust(w)  # noqa: E731
                               for j, (x, w) in enumerate(zip(r, widths)))
    top = (f"{model.name}: {model.params / 1e9:.1f} B params, {model.weight_bytes / 1e9:.1f} GB weights, "
           f"{model.kv_bytes_per_token / 1e6:.2f} MB KV/token; context {context}")
    foot = ("* homogeneous baseline. usd = device capex; $/Mtok = capex over 3 years of 24/7 decoding. "
            "mb = micro-batches.")
    return "\n".join([top, "", line(head), line(["-" * w for w in widths]), *map(line, body), "", foot])


def run(args: argparse.Namespace) -> int:
    """Execute a parsed ``lamina plan`` command. Returns the exit status."""
    try:
        model = replace(resolve_model(args.model), kv_dtype=args.kv_dtype)
        catalog = load_catalog(args.catalog)
        if args.context < 1 or args.top < 1:
            raise ValueError("--context and --top must be >= 1")
        c = Constraints(max_devices=args.max_devices, devices_per_node=args.devices_per_node,
                        nodes=args.nodes, nic_bw=args.nic, nic_latency=args.nic_latency,
                        nic_shared=args.nic_shared, tbt_slo=args.tbt_slo, ttft_slo=args.ttft_slo,
                        budget_usd=args.budget_usd, batch=args.batch)
    except (CatalogError, ValueError, KeyError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    computes = [d for d in catalog.values() if d.can("compute")]
    memories = [d for d in catalog.values() if d.can("memory")]
    out: Outcome = search(model, computes, memories, args.context, c, DEFAULT)
    if not out.plans:
        print(f"error: {binding_message(out, c)}", file=sys.stderr)
        return 1
    rows = out.plans[:args.top]
    if out.baseline is not None and out.baseline not in rows:
        rows.append(out.baseline)
    if args.json:
        print(json.dumps([as_dict(p, out.baseline) for p in rows], indent=1))
    else:
        print(format_table(model, args.context, rows, out.baseline))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``lamina plan`` on the top-level CLI's subparsers."""
    p = sub.add_parser("plan", help="deployments within device, node, network, latency and budget limits",
                       description=__doc__.split("\n")[0])
    add_arguments(p)
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lamina plan", description=__doc__.split("\n")[0])
    add_arguments(ap)
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())

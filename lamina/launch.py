"""``lamina launch``: Ray-placed instances behind an OpenAI-compatible HTTP server.

``--instances I`` runs I instances (each a compute replica and ``--memory`` memory nodes); the
server's router puts each request on the least-loaded one, and with more than one instance their
pools lend KV space to each other (cluster borrowing, :mod:`lamina.deployment`).

Start-up shows progress while Ray, the compute replica and the memory nodes come up, then
prints one readiness line with the URL. SIGINT/SIGTERM stop the server, the actors and (when
we started it) Ray: nothing is left behind.
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading
import time

from tqdm import tqdm

STAGES_PER_INSTANCE = 3


def run_launch(args: argparse.Namespace) -> int:
    import uvicorn

    from lamina.async_engine import AsyncEngine
    from lamina.cluster import start_deployment
    from lamina.models import ModelLoadError, load_tokenizer
    from lamina.server import build_app

    planned = args.instances > 1 and args.borrowing and args.plan_every > 0
    stages = 2 + STAGES_PER_INSTANCE * args.instances + planned
    bar = tqdm(total=stages, desc="lamina launch", unit="stage", file=sys.stderr,
               bar_format="{desc}: {n}/{total} {postfix}")

    def progress(stage: str) -> None:
        bar.set_postfix_str(stage)
        bar.update(1)

    try:
        progress("loading the tokenizer")
        tokenizer = load_tokenizer(args.model)
        deployment = start_deployment(
            args.model, instances=args.instances, compute=args.compute, memory=args.memory,
            transport=args.transport, address=args.address, device=args.device,
            memory_device=args.memory_device, kv_cache_gb=args.kv_cache_gb,
            kv_cache_tokens=args.kv_cache_tokens, slab_size=args.slab_size,
            borrowing=args.borrowing, plan_every=args.plan_every,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            tokenizer=tokenizer, progress=progress)
    except (ValueError, ModelLoadError) as e:
        bar.close()
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        cluster = deployment.instances[0].host
        info = cluster.info
        aengine = AsyncEngine(deployment, tokenizer)
        name = args.served_model_name or args.model
        app = build_app(aengine, tokenizer, name, api_key=args.api_key,
                        max_model_len=info["max_model_len"])
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                               log_level="warning", access_log=False))

        def announce() -> None:
            while not server.started and not server.should_exit:
                time.sleep(0.05)
            if server.started:
                bar.close()
                print(f"Lamina ready: http://{args.host}:{args.port}/v1 (model {name}, "
                      f"instances {args.instances}, compute {args.compute}, memory {args.memory}, "
                      f"borrowing {'on' if deployment.borrowing else 'off'}, transport "
                      f"{cluster.transports['engine-replica']}/"
                      f"{cluster.transports['replica-memory']})", flush=True)

        threading.Thread(target=announce, daemon=True).start()
        # uvicorn re-raises the signal that stopped it once it has shut down; with these
        # handlers that is a no-op, so the cluster is stopped below instead of dying mid-way.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
        server.run()  # until SIGINT / SIGTERM
        aengine.shutdown()
    finally:
        bar.close()
        deployment.close()
    print("Lamina stopped", flush=True)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("launch", help="serve a model over an OpenAI-compatible API, with "
                                      "compute and memory nodes placed by Ray")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--served-model-name", help="the model id clients use (default: --model)")
    p.add_argument("--instances", type=int, default=1,
                   help="instances (engine + compute replicas + memory pool), behind one router")
    p.add_argument("--compute", type=int, default=1, help="compute replicas per instance")
    p.add_argument("--memory", type=int, default=1, help="memory nodes per instance")
    p.add_argument("--no-borrowing", dest="borrowing", action="store_false",
                   help="with several instances, do not lend KV space between their pools")
    p.add_argument("--plan-every", type=int, default=0, metavar="K",
                   help="run the gManager's greedy KV placement every K rounds (0: reactive "
                        "borrowing only)")
    p.add_argument("--slab-size", type=int, default=64,
                   help="KV slots per slab (the unit of lending and moving)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument("--address", help="join an existing Ray cluster (default: start a local one)")
    p.add_argument("--transport", default="auto", choices=["auto", "shm", "tcp"],
                   help="data plane: auto = shm on one host, tcp across hosts")
    p.add_argument("--device", default="cpu", help="compute replica device")
    p.add_argument("--memory-device", help="memory node device (default: --device)")
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV budget per memory node")
    p.add_argument("--kv-cache-tokens", type=int, help="exact KV slots per memory node")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.set_defaults(func=run_launch)

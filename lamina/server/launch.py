"""``lamina launch``: a deployment behind an OpenAI-compatible HTTP server.

``--instances I`` runs I instances (each ``--compute`` replicas and ``--memory`` memory nodes,
placed by ``--placement``, Ray by default); the router puts each request on the least-loaded
one, and with more than one instance their pools lend KV space to each other (cluster
borrowing, :mod:`lamina.deployment`). ``--compute N`` runs rotational staggered pipelining
with ``N + 1`` micro-batches unless told otherwise.

Start-up shows progress while the model loads and the roles come up, then prints one
readiness line with the URL, and one with the start's seconds and each role's (spawn to ready). SIGINT/SIGTERM stop the server, every role and (when we started
it) Ray: nothing is left behind.
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading
import time

from tqdm import tqdm

from lamina import stages
from lamina.cli_args import add_deployment_args, config_from_args
from lamina.config import ServerConfig
from lamina.proctitle import set_title


def run_launch(args: argparse.Namespace) -> int:
    import uvicorn

    from lamina.deployment import start_deployment
    from lamina.models import ModelLoadError
    from lamina.server.app import build_app
    from lamina.server.async_engine import AsyncEngine

    set_title("lamina: server")
    started = time.perf_counter()
    bar = tqdm(desc="lamina launch", unit="stage", file=sys.stderr,
               bar_format="{desc}: {n} {postfix}")

    def progress(stage: str) -> None:
        bar.set_postfix_str(stage)
        bar.update(1)

    try:
        config = config_from_args(args)
        server_cfg = ServerConfig(args.host, args.port, args.api_key, args.served_model_name,
                                  args.max_queued_requests)
        deployment = start_deployment(config, progress=progress)
        seconds, roles = time.perf_counter() - started, stages.roles_ready(stages.take())
    except (ValueError, ModelLoadError) as e:
        bar.close()
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        engine = deployment.instances[0].engine
        running = config.instances * config.scheduler.max_num_seqs
        aengine = AsyncEngine(deployment, engine.tokenizer,
                              max_open=running + server_cfg.max_queued_requests)
        name = server_cfg.served_model_name or config.model.model
        app = build_app(aengine, engine.tokenizer, name, api_key=server_cfg.api_key,
                        max_model_len=engine.scheduler.config.max_model_len)
        server = uvicorn.Server(uvicorn.Config(app, host=server_cfg.host, port=server_cfg.port,
                                               log_level="warning", access_log=False))
        icfg = config.instance

        def announce() -> None:
            while not server.started and not server.should_exit:
                time.sleep(0.05)
            if server.started:
                bar.close()
                print(f"Lamina ready: http://{server_cfg.host}:{server_cfg.port}/v1 (model {name}, "
                      f"placement {icfg.placement}, instances {config.instances}, compute "
                      f"{icfg.compute}, memory {icfg.memory}, pipeline {icfg.pipeline.schedule} "
                      f"x{icfg.pipeline.micro_batches}, borrowing "
                      f"{'on' if deployment.borrowing else 'off'}, transport {icfg.transport})",
                      flush=True)
                print(f"Started in {seconds:.1f} s" + (f"; roles ready in: {roles}" if roles
                                                        else ""), flush=True)

        threading.Thread(target=announce, daemon=True).start()
        # uvicorn re-raises the signal that stopped it once it has shut down; with these
        # handlers that is a no-op, so the deployment is stopped below instead of dying mid-way.
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
                                      "compute and memory nodes placed by Ray (or --placement)")
    add_deployment_args(p, placement="ray")
    s = ServerConfig()
    p.add_argument("--served-model-name", help="the model id clients use (default: --model)")
    p.add_argument("--host", default=s.host)
    p.add_argument("--port", type=int, default=s.port)
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 routes "
                                     "(/health and /metrics stay open)")
    p.add_argument("--max-queued-requests", type=int, default=s.max_queued_requests,
                   help="requests that may wait beyond the running ones; more get 429 with "
                        "Retry-After")
    p.set_defaults(func=run_launch)

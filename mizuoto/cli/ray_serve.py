"""`mizuoto ray-serve CONFIG.yaml`: the HTTP API from Ray Serve replicas (see docs/ray.md)."""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time

from mizuoto.errors import MizuotoError


def add_ray_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The ray-serve arguments."""
    p.add_argument("config", help="YAML file: models, replicas, per-replica limits and budgets (docs/ray.md)")
    p.add_argument("--ready-file", help="write the URL here once the application answers (for scripts)")


def run_ray_serve(args: argparse.Namespace) -> int:
    """Start (or join) Ray, run the application, serve until SIGINT/SIGTERM, then shut it all down."""
    from mizuoto.server.ray_serve import INSTALL, build_app, read_config

    config = read_config(args.config)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage report leaves the machine
    try:
        import ray
        from ray import serve
    except ImportError:
        raise MizuotoError(f"mizuoto ray-serve needs Ray Serve: {INSTALL}") from None
    app = build_app(config)
    if config.address is not None:
        ray.init(address=config.address, log_to_driver=False)
    else:
        ray.init(num_cpus=config.cluster_cpus, include_dashboard=False, log_to_driver=False,
                 _node_ip_address="127.0.0.1")
    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():  # after ray.init, which installs its own
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": config.host, "port": config.port})
        serve.run(app, name="mizuoto", route_prefix="/")
        url = f"http://{config.host}:{config.port}"
        print(f"mizuoto ray-serve: {url} ({config.replicas} replica(s), models: {', '.join(config.models)})",
              flush=True)
        if args.ready_file:
            from mizuoto.files import atomic_write_bytes

            atomic_write_bytes(args.ready_file, url.encode())
        while not stop.is_set():
            time.sleep(0.2)
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0

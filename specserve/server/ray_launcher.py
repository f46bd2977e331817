"""`specserve serve-ray`: N engine replicas on Ray Serve behind one OpenAI-compatible endpoint,
routed by prompt prefix (server/ray_serve.py), until SIGINT or SIGTERM.

This module imports no Ray: the command's arguments are parsed and checked first, and Ray is
imported only to run it, with a clear message when it is not installed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
from pathlib import Path

from specserve import engine_args
from specserve.errors import InvalidParameterError, SpecserveError
from specserve.server import launcher

APP_NAME = "specserve"


def add_serve_ray_parser(sub) -> None:
    s = sub.add_parser("serve-ray", help="run N engine replicas on Ray Serve behind one OpenAI-compatible endpoint",
                       description="Starts a local Ray cluster bound to 127.0.0.1 (or joins one with --ray-address), "
                                   "deploys --num-replicas specserve engines and one HTTP ingress that routes each "
                                   "request to the replica most likely to hold its prompt's prefix in its KV cache. "
                                   "Needs Ray Serve: pip install 'specserve[ray]'.")
    engine_args.add_config_arg(s)
    engine_args.add_model_args(s)
    engine_args.add_spec_args(s)
    engine_args.add_engine_args(s, serving=True)
    s.add_argument("--host", default="127.0.0.1", help="address Ray's HTTP proxy binds (default loopback only)")
    s.add_argument("--port", type=int, default=8000, help="port Ray's HTTP proxy binds (default 8000)")
    s.add_argument("--num-replicas", type=int, default=2, help="engine replicas, each with the whole model (default 2)")
    s.add_argument("--cpus-per-replica", type=float, default=1.0,
                   help="CPUs Ray reserves for each engine replica; its kernels use as many threads (default 1)")
    s.add_argument("--ray-address", default="local",
                   help="'local' (the default): start a Ray cluster of this machine, bound to 127.0.0.1; or the "
                        "address of a running cluster ('auto', HOST:PORT) to place replicas on its machines, where "
                        "specserve and the model must be installed at the same paths")
    s.add_argument("--route-chunk-chars", type=int, default=64,
                   help="characters per prefix chunk the router matches (default 64: about one 16-token KV block)")
    s.add_argument("--route-imbalance", type=int, default=None,
                   help="requests by which a replica's queue may exceed another's before prefix affinity yields to "
                        "load (default: --max-num-seqs)")
    launcher.add_server_args(s, connections=False)


def run_serve_ray(args) -> int:
    from specserve.config_file import load_config_file

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("specserve.server")
    file = load_config_file(args.config)
    launcher.check_server_args(args)
    if args.num_replicas < 1:
        raise InvalidParameterError("num_replicas", args.num_replicas, "must be >= 1")
    if not args.cpus_per_replica >= 0:
        raise InvalidParameterError("cpus_per_replica", args.cpus_per_replica, "must be >= 0")
    if args.route_chunk_chars < 1:
        raise InvalidParameterError("route_chunk_chars", args.route_chunk_chars, "must be >= 1")
    engine = engine_args.engine_kwargs(args, file)
    imbalance = engine["max_num_seqs"] if args.route_imbalance is None else args.route_imbalance
    if imbalance < 0:
        raise InvalidParameterError("route_imbalance", imbalance, "must be >= 0")
    rs = _import_ray_serve()
    spec = replica_spec(args, file)
    options = rs.DeploymentOptions(num_replicas=args.num_replicas, cpus_per_replica=args.cpus_per_replica,
                                   max_ongoing_requests=engine["max_num_seqs"] + args.max_waiting,
                                   grace_period_s=args.grace_period, chunk_chars=args.route_chunk_chars,
                                   imbalance=imbalance)
    start_ray(args.ray_address)
    try:
        url = rs.deploy(spec, options, guard(args), args.host, args.port, APP_NAME)
        log.info("serving %d replica(s) of %s on %s/v1 (Ray Serve; prefix-affinity routing)", args.num_replicas,
                 spec.load["model"], url)
        _wait_for_signal()
    finally:
        stop_ray()
    log.info("stopped")
    return 0


def replica_spec(args, file: dict):
    """The ReplicaSpec the command's arguments describe (the same for every replica)."""
    from specserve.server.ray_serve import ReplicaSpec

    config = launcher.server_config(args, "-", 1)
    server = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
              if f.name not in ("served_model_names", "max_model_len")}
    names = tuple(args.served_model_name) if args.served_model_name else None
    return ReplicaSpec(load=engine_args.load_kwargs(args, file), engine=engine_args.engine_kwargs(args, file),
                       speculative=engine_args.speculative_config(args, file), server=server,
                       served_model_names=names, max_waiting=args.max_waiting)


def guard(args) -> dict:
    """The ingress Guard's settings: those of every replica's own app."""
    return {"api_key": args.api_key, "max_body_bytes": args.max_body_bytes, "body_timeout_s": args.body_timeout,
            "allowed_hosts": launcher.allowed_hosts(args.host, args.allowed_host)}


def start_ray(address: str, num_cpus: int | None = None) -> None:
    """Start a Ray cluster of this machine bound to 127.0.0.1 (`address` "local"), or join one."""
    import ray

    if address == "local":
        # Ray's workers must import the specserve this command runs (a source checkout too): they
        # inherit the environment of the cluster a local ray.init starts.
        root = str(Path(__file__).resolve().parents[2])
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
                 log_to_driver=False)
    else:
        ray.init(address=address, log_to_driver=False)


def stop_ray() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def _import_ray_serve():
    try:
        from specserve.server import ray_serve
    except ImportError as e:
        if "ray" not in (e.name or "").split("."):
            raise
        raise SpecserveError("serve-ray needs Ray Serve, which is not installed: "
                             "pip install 'specserve[ray]'") from None
    return ray_serve


def _wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _signum, _frame: stop.set())
    while not stop.wait(1.0):
        pass

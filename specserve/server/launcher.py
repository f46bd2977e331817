"""`specserve serve`: load the model, build the engine and the app, run uvicorn until SIGTERM.

Shutdown: on SIGTERM (or Ctrl-C) uvicorn stops accepting connections and lets open requests
run for up to --grace-period seconds; then the engine aborts the rest, whose streams end with a
last chunk (finish_reason "abort") and `data: [DONE]` (server/shutdown.py). The app's lifespan
stops the engine thread and the process exits 0.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import resource
import signal
import socket
import time

from specserve import engine_args
from specserve.errors import InvalidParameterError


def add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                       description="POST /v1/completions, /v1/chat/completions; GET /v1/models, /health, /metrics, "
                                   "and the playground page at /")
    engine_args.add_config_arg(s)
    engine_args.add_model_args(s)
    engine_args.add_spec_args(s)
    engine_args.add_engine_args(s, serving=True)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only; 0.0.0.0 for all)")
    s.add_argument("--port", type=int, default=8000, help="port to bind (0: any free port, printed at start)")
    add_server_args(s)


def add_server_args(s, connections: bool = True) -> None:
    """The HTTP server's own options (`serve`; `serve-ray` without the connection-level ones,
    which Ray's HTTP proxy owns there)."""
    s.add_argument("--allowed-host", action="append", default=None, metavar="NAME",
                   help="also answer requests whose Host header is NAME (repeatable; '*': any). Bound to a loopback "
                        "address the server answers local names only (localhost, 127.0.0.0/8, [::1]), so that a "
                        "page on another site cannot reach it through DNS rebinding; bound elsewhere it checks Host "
                        "only when this is given")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    s.add_argument("--served-model-name", action="append", default=None,
                   help="name clients use in 'model' (repeatable; default: the model's own name)")
    s.add_argument("--max-waiting", type=int, default=256,
                   help="waiting requests beyond the running batch; more get 503 with Retry-After (0: none wait)")
    s.add_argument("--max-request-choices", type=int, default=64,
                   help="engine requests one HTTP request may make (prompts x n); more get 400 (default 64)")
    s.add_argument("--max-body-bytes", type=int, default=2 << 20, help="larger request bodies get 413")
    if connections:
        s.add_argument("--header-timeout", type=float, default=10.0,
                       help="seconds a connection may take to send complete request headers; slower ones get 408 "
                            "and the connection closes (default 10)")
        s.add_argument("--max-connections", type=int, default=1024,
                       help="open connections; a new one past this gets 503 and is closed (default 1024)")
    else:
        s.set_defaults(header_timeout=10.0, max_connections=1024)
    s.add_argument("--body-timeout", type=float, default=10.0,
                   help="seconds a request body may take to arrive; slower ones get 408 and the connection closes")
    s.add_argument("--grace-period", type=float, default=30.0, help="seconds running requests get on SIGTERM")
    s.add_argument("--no-ui", action="store_true", help="do not serve the playground page at / (it is on by default)")
    s.add_argument("--log-prompts", action="store_true", help="include prompt text in the per-request log line")
    s.add_argument("--special-tokens-in-content", action="store_true",
                   help="encode control-token text in chat messages (e.g. <|im_end|>) as control tokens, as vLLM does; "
                        "off by default, so a user cannot forge a system turn")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def run_serve(args) -> int:
    from specserve.config import SpeculativeConfig
    from specserve.config_file import load_config_file
    from specserve.engine.async_engine import build_off_thread
    from specserve.llm import LLM
    from specserve.model.loader import load_model
    from specserve.server.connections import connection_protocol
    from specserve.server.shutdown import DrainingServer

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("specserve.server")
    # Everything the user typed is checked before seconds go into loading the model.
    file = load_config_file(args.config)
    spec = engine_args.speculative_config(args, file)
    if (sc := SpeculativeConfig.from_dict(spec)) is not None and sc.lossy:
        log.warning("typical acceptance is on: sampled responses are NOT exactly the target model's distribution "
                    "(lossy; greedy responses are unchanged)")
    check_server_args(args)
    _allow_files(args.max_connections)
    sock = _bind(args.host, args.port)

    t = time.perf_counter()

    def build():
        loaded = load_model(**engine_args.load_kwargs(args, file))
        return LLM(loaded=loaded, speculative_config=spec, **engine_args.engine_kwargs(args, file))

    llm = build_off_thread(build)  # off the main thread: the engine thread must be the only OpenMP master
    loaded = llm.target
    config = server_config(args, loaded.name, llm.engine_config.max_model_len, bound=sock.getsockname()[0])
    app, engine = build_app_for(llm, config, args.max_waiting)
    host, port = sock.getsockname()[:2]
    log.info("loaded %s in %.1fs (%s; speculation: %s; %s)", loaded.name, time.perf_counter() - t,
             loaded.kernels, spec["method"] if spec else "none", llm.kv_budget.describe())
    if loaded.notice:
        log.warning(loaded.notice)
    if llm.context_note:
        log.info(llm.context_note)
    log.info("serving %s on http://%s:%d/v1", ", ".join(config.served_model_names), host, port)
    if config.ui:
        log.info("playground: http://%s:%d/ (off with --no-ui)", host, port)

    server = DrainingServer(app, engine, args.grace_period, log_level=args.log_level, access_log=False, lifespan="on",
                            http=connection_protocol(config.header_timeout_s, config.max_connections))
    # uvicorn re-raises the signal that stopped it once it has shut down; a handler of our own
    # turns that into a normal return, so a SIGTERM'd server exits 0 after its graceful stop.
    stops: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stops.append(signum))
    asyncio.run(server.serve(sockets=[sock]))
    log.info("stopped%s", f" on signal {signal.Signals(stops[0]).name}" if stops else "")
    return 0


def check_server_args(args) -> None:
    """The server options' bounds, checked before any time goes into loading the model."""
    if not 0 <= args.port <= 65535:
        raise InvalidParameterError("port", args.port, "must be in [0, 65535]")
    if args.max_waiting < 0:
        raise InvalidParameterError("max_waiting", args.max_waiting, "must be >= 0")
    if args.max_body_bytes < 1024:
        raise InvalidParameterError("max_body_bytes", args.max_body_bytes, "must be >= 1024")
    if not args.grace_period >= 0:
        raise InvalidParameterError("grace_period", args.grace_period, "must be >= 0 seconds")
    if not args.body_timeout > 0:
        raise InvalidParameterError("body_timeout", args.body_timeout, "must be > 0 seconds")
    if not 0 < args.header_timeout <= 3600:
        raise InvalidParameterError("header_timeout", args.header_timeout, "must be in (0, 3600] seconds")
    if args.max_request_choices < 1:
        raise InvalidParameterError("max_request_choices", args.max_request_choices, "must be >= 1")


def server_config(args, model_name: str, max_model_len: int, bound: str | None = None):
    """The ServerConfig that `serve`'s arguments describe, for a model of that name and context,
    served on the address `bound` (default: --host as given)."""
    from specserve.server.serving import ServerConfig

    return ServerConfig(served_model_names=tuple(args.served_model_name or [model_name]), max_model_len=max_model_len,
                        api_key=args.api_key, max_body_bytes=args.max_body_bytes, body_timeout_s=args.body_timeout,
                        log_prompts=args.log_prompts, grace_period_s=args.grace_period, ui=not args.no_ui,
                        special_tokens_in_content=args.special_tokens_in_content,
                        allowed_hosts=allowed_hosts(bound or args.host, args.allowed_host),
                        header_timeout_s=args.header_timeout, max_connections=args.max_connections,
                        max_request_choices=args.max_request_choices)


def allowed_hosts(bound: str, names: list[str] | None) -> tuple[str, ...] | None:
    """The Host names a server bound to `bound` answers besides local ones (None: any): on a
    loopback address only local names unless `names` adds some; elsewhere any unless `names`
    is given. '*' among them: any."""
    names = [n.strip().lower().rstrip(".") for n in names or []]
    if "*" in names:
        return None
    for name in names:
        if not name or any(c in name for c in " /:[]@"):
            raise InvalidParameterError("allowed_host", name, "must be a host name or address without port, or '*'")
    if names or _is_loopback(bound):
        return tuple(names)
    return None


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return host.lower() == "localhost"


# Files the process holds besides its connections: the model, the listener, the interpreter's own.
_FILES_BESIDES_CONNECTIONS = 128


def _allow_files(max_connections: int) -> None:
    """Raise the open-file limit so that `max_connections` connections fit under it (each holds a
    descriptor), or refuse the cap: past the limit, accept() fails and nothing gets answered."""
    if max_connections < 1:
        raise InvalidParameterError("max_connections", max_connections, "must be >= 1")
    need = max_connections + _FILES_BESIDES_CONNECTIONS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    except (ValueError, OSError):  # above the hard limit, or the kernel's
        raise InvalidParameterError("max_connections", max_connections,
                                    f"this process may open {soft} files (ulimit -n) and cannot raise that "
                                    f"to {need}, so at most {soft - _FILES_BESIDES_CONNECTIONS} connections; lower "
                                    "--max-connections or raise the limit") from None


def build_app_for(llm, config, max_waiting: int | None):
    """The app around an LLM's engine, and the AsyncEngine it serves from (the server's and the
    tests' one way to make them)."""
    from specserve.engine.async_engine import AsyncEngine
    from specserve.server.app import build_app
    from specserve.server.metrics import ServerMetrics
    from specserve.server.serving import OpenAIServing

    engine = AsyncEngine(llm.engine, max_waiting=max_waiting)
    metrics = ServerMetrics(engine, config.served_model_names[0])
    return build_app(OpenAIServing(engine, llm.tokenizer, config, metrics), metrics), engine


def _bind(host: str, port: int) -> socket.socket:
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError):
        raise InvalidParameterError("host", host, "not an IP address or resolvable name") from None
    # IPPROTO_TCP, not the default 0: asyncio turns on TCP_NODELAY for the connections it
    # accepts only when the socket says it is TCP. Without it, Nagle's algorithm and the
    # client's delayed ACK hold each response's last segment back ~40 ms on a kept-alive
    # connection.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise InvalidParameterError("port", port, f"cannot bind {host}:{port} ({e.strerror}); pick another --port") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock

"""``quicksilver serve``: the OpenAI-compatible HTTP server (FastAPI + uvicorn)."""

from __future__ import annotations

import argparse
import os

from quicksilver.commands._decode_args import add_model_args
from quicksilver.decoding import DEFAULT_PREFILL_CHUNK, DEFAULT_PREFIX_CACHE_MB, PrefixCache


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", default=os.environ.get("QUICKSILVER_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $QUICKSILVER_API_KEY)")
    p.add_argument("--served-model-name", help="model id clients must send (default: the model folder's name)")
    p.add_argument("--max-batch", type=int, default=32, help="requests decoded together per forward")
    p.add_argument("--max-queue", type=int, default=256, help="waiting requests before answering 429")
    p.add_argument("--prefix-cache-mb", type=float, default=DEFAULT_PREFIX_CACHE_MB,
                   help="memory for keys of prompt prefixes shared between requests, e.g. a system prompt, tool "
                        f"list or earlier turns (block-causal and causal models; 0 turns it off; default "
                        f"{DEFAULT_PREFIX_CACHE_MB:g})")
    p.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
                   help="most prompt tokens a request computes per forward, so a long prompt does not stall the "
                        "requests decoding beside it (rounded down to whole model blocks, at least one, for "
                        "block-causal models unless they decode self-speculatively; bidirectional models always "
                        "prefill whole; "
                        f"0: whole prompts at once; default {DEFAULT_PREFILL_CHUNK})")
    p.add_argument("--index", help="retrieval index file for requests with \"retrieval\": {\"k\": N}")
    p.add_argument("--shutdown-timeout", type=float, default=60.0,
                   help="seconds to finish in-flight requests after SIGTERM")
    p.add_argument("--threads", type=int,
                   help="torch intra-op threads (default: torch's choice; 1 is often faster on a busy machine)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if args.max_batch < 1 or args.max_queue < 0:
        raise ValueError("--max-batch must be >= 1 and --max-queue >= 0")
    if args.index is not None:
        from quicksilver.rag.store import Index

        with Index(args.index, create=False):  # a missing or corrupt index: an error now, not at the first request
            pass
    if args.threads is not None and args.threads < 1:
        raise ValueError("--threads must be >= 1")
    if not args.shutdown_timeout >= 0:
        raise ValueError("--shutdown-timeout must be >= 0 seconds")
    PrefixCache.check_size(args.prefix_cache_mb)
    if args.prefill_chunk < 0:
        raise ValueError("--prefill-chunk must be >= 0 (0: whole prompts at once)")
    check_listen(args.host, args.port)  # a port in use: one line now, not uvicorn's log after the model loads
    import torch
    import uvicorn

    from quicksilver.api.server import create_app
    from quicksilver.engine import model_thread
    from quicksilver.loading import load_model
    from quicksilver.variants import variant_of

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    worker = model_thread()  # the engine's model thread loads the weights too: one thread runs all torch work
    if args.compile:  # the warm-up is silent and can take a while: say why the server is not up yet
        print("quicksilver serve: compiling the model's layers (about 40 s the first time) ...", flush=True)
    loaded = worker.submit(load_model, args.model, None, args.precision, args.device, args.compile).result()
    app = create_app(loaded, api_key=args.api_key, index_path=args.index,
                     served_model_name=args.served_model_name, max_batch=args.max_batch, max_queue=args.max_queue,
                     prefix_cache_mb=args.prefix_cache_mb, prefill_chunk=args.prefill_chunk, worker=worker)
    where = "" if loaded.model.device.type == "cpu" else f" on {loaded.model.device}"
    print(f"quicksilver serve: model {loaded.name!r} ({variant_of(loaded.model)}{where}; "
          f"prefix cache {args.prefix_cache_mb:g} MB, prefill chunk {args.prefill_chunk or 'off'}) "
          f"on http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=args.shutdown_timeout)
    return 0


def check_listen(host: str, port: int) -> None:
    """OSError (one line) unless ``host:port`` can be listened on now: an unknown host or a port in use."""
    import socket

    if not host:  # "": every interface, as uvicorn (asyncio) reads it; left to uvicorn
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise OSError(f"--host {host!r}: cannot resolve it ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a TIME_WAIT port is free
        if family == socket.AF_INET6:  # as asyncio binds it: IPv6 only, so an IPv4 listener does not clash
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            raise OSError(f"cannot listen on {host}:{port}: {exc.strerror}") from None

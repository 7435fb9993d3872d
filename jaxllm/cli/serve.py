"""``jaxllm serve``: an OpenAI-compatible server for many endless conversations at once
(jaxllm.serve: a pool of cache rows, continuous batching, sessions that keep their cache)."""
from __future__ import annotations

import os
import sys

from ..argtypes import COUNT, integer
from ..chat import BURST
from ..policy import METHODS
from .common import (DEFAULT_MODEL, MODEL_HELP, CliError, add_policy_args, add_weights_arg,
                     flag_names, load, policy)

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def add_serve(sub) -> None:
    p = sub.add_parser("serve", help="serve the model over HTTP (OpenAI-compatible "
                                     "/v1/chat/completions and /v1/completions): many streams "
                                     "at once, each through its own row of a StreamingLLM cache")
    p.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    p.add_argument("--slots", type=integer(1, 4096), default=8,
                   help="cache rows: streams answered at once")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default loopback only; 0.0.0.0 for every "
                        "interface, with --api-key)")
    p.add_argument("--port", type=integer(0, 65535), default=8000, help="port (0: any free one)")
    p.add_argument("--api-key", default=os.environ.get("JAXLLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default $JAXLLM_API_KEY; none: "
                        "open)")
    p.add_argument("--max-queue", type=integer(0, 1 << 20), default=64,
                   help="requests waiting for a row before new ones get 429")
    p.add_argument("--max-sessions", type=integer(0, 1 << 20), default=256,
                   help="sessions kept (rows, then host memory); the least recently used go")
    p.add_argument("--session-ttl", type=integer(1, 1 << 30), default=3600,
                   help="seconds an idle session is kept")
    p.add_argument("--max-tokens", type=COUNT, default=1024,
                   help="the most tokens one answer may ask for")
    p.add_argument("--max-prompt", type=COUNT, default=32768,
                   help="the most tokens one request may feed")
    p.add_argument("--burst", type=COUNT, default=BURST,
                   help=f"decode steps per call while no request waits (default {BURST}; 1: a "
                        f"call a token, the text streamed a token at a time, slower)")
    p.add_argument("--name", default=None, help="the model id clients name (default: --model)")
    add_policy_args(p, methods=[m for m, c in METHODS.items() if c.keeps_cache and c.streams],
                    chunk=False)
    add_weights_arg(p, file_blocks=True)
    p.set_defaults(fn=cmd_serve)


def cmd_serve(a) -> None:
    try:
        import uvicorn
    except ImportError:
        raise CliError("jaxllm serve needs uvicorn and starlette: pip install uvicorn "
                       "starlette") from None
    from ..serve import Engine, make_app
    pc = policy(a)
    cfg, params, tok = load(a.model, weights=a.weights, keep_quantized=a.keep_quantized,
                            int8_inputs=a.int8_inputs,
                            file_blocks=True)
    try:
        engine = Engine(params, cfg, tok, pc, slots=a.slots, max_queue=a.max_queue,
                        max_sessions=a.max_sessions, session_ttl=a.session_ttl,
                        max_prompt=a.max_prompt, burst=a.burst)
    except ValueError as e:
        raise CliError(flag_names(e)) from None
    if a.host not in LOOPBACK and a.api_key is None:
        print(f"warning: serving on {a.host} with no --api-key: anyone who reaches this port "
              f"can use it", file=sys.stderr)
    print(f"compiling the pool's programs ({a.slots} rows, {pc.label}) ...", file=sys.stderr)
    engine.warm_up()
    name = a.name or a.model
    app = make_app(engine, name, a.api_key, a.max_tokens)
    config = uvicorn.Config(app, host=a.host, port=a.port, log_level="warning",
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)

    def ready():
        sock = server.servers[0].sockets[0].getsockname() if server.servers else (a.host, a.port)
        print(f"serving {name} on http://{a.host}:{sock[1]} ({a.slots} rows, {pc.label}); "
              f"Ctrl-C stops", file=sys.stderr, flush=True)

    _announce(server, ready)
    server.run()


def _announce(server, ready) -> None:
    """Say where the server listens once it does (uvicorn's startup hook)."""
    startup = server.startup

    async def wrapped(*args, **kw):
        await startup(*args, **kw)
        ready()
    server.startup = wrapped

"""An OpenAI-compatible HTTP server around the engine (jaxllm.serve.engine): Starlette for the
routes and server-sent events, uvicorn to serve them (both small, well kept, pure Python).

Routes: ``POST /v1/chat/completions`` and ``/v1/completions`` (streamed as server-sent events
or not), ``GET /v1/models``, ``/health``, ``/metrics`` (Prometheus text). Extension fields of a
request: ``session_id`` (a conversation that keeps its cache row between requests: send each
turn's whole message list as usual, and only the new turn is encoded) and ``top_k``. A
response says what happened to its session in ``session`` (``restored`` from host memory,
``reencoded`` because the history differed, ``prompt_tokens`` fed).

Requests are checked before they reach the engine; every error is OpenAI's shape
(``{"error": {"message", "type", "param", "code"}}``) with status 400 (bad request), 401 (API
key), 404 (model, route), 413 (body too large) or 429 (queue full, with Retry-After). A client
that disconnects cancels its request, and its row is free at the next step.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import threading
import time
import uuid
from typing import Optional

from .engine import Engine, QueueFull, Request, Result, Sampling

MAX_BODY = 1 << 22  # bytes of one request
ROLES = ("system", "user", "assistant")
COMMON = {"model", "stream", "stream_options", "temperature", "top_p", "top_k", "max_tokens",
          "stop", "seed", "n", "user", "session_id", "presence_penalty", "frequency_penalty",
          "logprobs"}
FIELDS = {"chat": COMMON | {"messages", "max_completion_tokens", "top_logprobs"},
          "text": COMMON | {"prompt", "echo", "suffix", "best_of"}}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (status, message, param,
                                                                       code, kind)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def _number(d: dict, name: str, lo: float, hi: float, default, integer: bool = False):
    if name not in d or d[name] is None:
        return default
    x = d[name]
    if isinstance(x, bool) or not isinstance(x, (int, float)) or (integer and not (
            isinstance(x, int) or float(x).is_integer())) or not math.isfinite(x):
        raise ApiError(400, f"{name} must be {'an integer' if integer else 'a number'}, got "
                            f"{json.dumps(x)}", name)
    if not lo <= x <= hi:
        raise ApiError(400, f"{name} must lie in [{lo:g}, {hi:g}], got {x}", name)
    return int(x) if integer else float(x)


def _text(content, where: str) -> str:
    """A message's content: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"{where}.content must be a string or a list of text parts", where)


def parse(d, kind: str, model_id: str, max_tokens: int) -> Request:
    """A request body (``kind``: "chat" or "text") as an engine Request; ApiError on anything
    it cannot honour."""
    if not isinstance(d, dict):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = sorted(set(d) - FIELDS[kind])
    if unknown:
        raise ApiError(400, f"unrecognized request argument supplied: {', '.join(unknown)}",
                       unknown[0])
    if not isinstance(d.get("model"), str):
        raise ApiError(400, "model must be a string (GET /v1/models lists it)", "model")
    if d["model"] != model_id:
        raise ApiError(404, f"the model {d['model']!r} does not exist; this server serves "
                            f"{model_id!r}", "model", "model_not_found")
    if _number(d, "n", 1, 1, 1, True) != 1 or _number(d, "best_of", 1, 1, 1, True) != 1:
        raise ApiError(400, "n must be 1 (one answer per request)", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(d, name, -2, 2, 0.0) != 0.0:
            raise ApiError(400, f"{name} is not supported (leave it out or 0)", name)
    for name in ("logprobs", "echo"):
        if d.get(name) not in (None, False, 0):
            raise ApiError(400, f"{name} is not supported", name)
    if d.get("suffix") not in (None, ""):
        raise ApiError(400, "suffix is not supported", "suffix")
    if not isinstance(d.get("stream", False), bool):
        raise ApiError(400, "stream must be true or false", "stream")
    so = d.get("stream_options")
    if so is not None and not (isinstance(so, dict) and set(so) <= {"include_usage"}
                               and isinstance(so.get("include_usage", False), bool)):
        raise ApiError(400, "stream_options takes include_usage (true or false)",
                       "stream_options")
    stop = d.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not (isinstance(stop, (list, tuple)) and len(stop) <= 4
            and all(isinstance(s, str) and s for s in stop)):
        raise ApiError(400, "stop must be a non-empty string or a list of up to 4", "stop")
    limit = _number(d, "max_completion_tokens", 1, max_tokens, None, True)
    limit = _number(d, "max_tokens", 1, max_tokens, limit, True)
    sid = d.get("session_id")
    if sid is not None and not (isinstance(sid, str) and 0 < len(sid) <= 128):
        raise ApiError(400, "session_id must be a string of 1 to 128 characters", "session_id")
    if d.get("user") is not None and not isinstance(d["user"], str):
        raise ApiError(400, "user must be a string", "user")
    sampling = Sampling(temperature=_number(d, "temperature", 0, 2, 1.0),
                        top_p=_number(d, "top_p", 1e-9, 1, 1.0),
                        top_k=_number(d, "top_k", 0, 1 << 20, 0, True),
                        seed=_number(d, "seed", -(2 ** 63), 2 ** 63 - 1, 0, True) % (2 ** 31),
                        max_tokens=limit or (16 if kind == "text" else max_tokens),
                        stop=tuple(stop))
    if kind == "text":
        prompt = d.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(400, "prompt must be a non-empty string", "prompt")
        return Request(prompt=prompt, sampling=sampling, session=sid)
    msgs = d.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    out = []
    for j, m in enumerate(msgs):
        where = f"messages[{j}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(400, f"{where} must be an object whose role is one of "
                                f"{', '.join(ROLES)}", where)
        if set(m) - {"role", "content", "name"}:
            raise ApiError(400, f"{where} has fields this server does not take: "
                                f"{', '.join(sorted(set(m) - {'role', 'content', 'name'}))}", where)
        out.append({"role": m["role"], "content": _text(m.get("content"), where)})
    if out[-1]["role"] != "user":
        raise ApiError(400, "the last message must be the user's", "messages")
    return Request(messages=out, sampling=sampling, session=sid)


def _usage(res: Result) -> dict:
    return {"prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens,
            "total_tokens": res.prompt_tokens + res.completion_tokens}


def _session(res: Result) -> Optional[dict]:
    if res.session is None:
        return None
    return {"id": res.session, "restored": res.restored, "reencoded": res.reencoded,
            "prompt_tokens": res.prompt_tokens}


def make_app(engine: Engine, model_id: str, api_key: Optional[str] = None,
             max_tokens: int = 4096):
    """The Starlette application serving ``engine`` as ``model_id``; ``api_key``: required as
    ``Authorization: Bearer KEY`` when given. The engine runs in a thread from startup to
    shutdown."""
    from starlette.applications import Starlette
    from starlette.requests import Request as HttpRequest
    from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route

    created = int(time.time())
    started = time.time()

    def error(e: ApiError) -> JSONResponse:
        headers = {"Retry-After": "1"} if e.status == 429 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    def check_key(request: HttpRequest) -> None:
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            raise ApiError(401, "a valid API key is needed (Authorization: Bearer KEY)",
                           code="invalid_api_key", kind="authentication_error")

    async def health(request):
        return JSONResponse({"status": "ok", "model": model_id})

    async def models(request):
        try:
            check_key(request)
        except ApiError as e:
            return error(e)
        return JSONResponse({"object": "list", "data": [
            {"id": model_id, "object": "model", "created": created, "owned_by": "jaxllm"}]})

    async def metrics(request):
        m = engine.snapshot()
        up = time.time() - started
        lines = []

        def put(name, kind, value, help):
            lines.extend([f"# HELP jaxllm_{name} {help}", f"# TYPE jaxllm_{name} {kind}",
                          f"jaxllm_{name} {value}"])
        put("queue_depth", "gauge", m["queue"], "requests waiting for a row")
        put("rows_busy", "gauge", m["rows_busy"], "cache rows answering a request")
        put("rows", "gauge", m["rows"], "cache rows in the pool")
        put("sessions", "gauge", m["sessions"], "sessions held")
        put("sessions_on_host", "gauge", m["sessions_on_host"], "sessions saved to host memory")
        for k, help in (("requests", "requests accepted"), ("rejected", "requests refused, "
                        "queue full"), ("finished", "requests answered or cancelled"),
                        ("errors", "requests refused by the engine"),
                        ("prompt_tokens", "prompt tokens fed"),
                        ("completion_tokens", "tokens generated"),
                        ("steps", "decode steps"),
                        ("decode_calls", "decode calls (a burst of steps each)"),
                        ("sessions_saved", "rows saved to host"),
                        ("sessions_restored", "rows restored from host"),
                        ("sessions_expired", "sessions dropped")):
            put(f"{k}_total", "counter", m.get(k, 0), help)
        for k in ("prefill_seconds", "decode_seconds"):
            put(f"{k}_total", "counter", f"{m.get(k, 0.0):.6f}", f"time in {k.split('_')[0]}")
        put("generation_tokens_per_second", "gauge",
            f"{m.get('completion_tokens', 0) / max(m.get('decode_seconds', 0.0), 1e-9):.3f}",
            "tokens generated per second of decoding")
        put("uptime_seconds", "gauge", f"{up:.1f}", "seconds since start")
        return PlainTextResponse("\n".join(lines) + "\n",
                                 media_type="text/plain; version=0.0.4")

    async def body_of(request) -> dict:
        raw = await request.body()
        if len(raw) > MAX_BODY:
            raise ApiError(413, f"the request body is {len(raw)} bytes, over {MAX_BODY}")
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None

    async def complete(request: HttpRequest, kind: str) -> Response:
        try:
            check_key(request)
            d = await body_of(request)
            r = parse(d, kind, model_id, max_tokens)
        except ApiError as e:
            return error(e)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        r.emit = lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev)
        try:
            engine.submit(r)
        except QueueFull as e:
            return error(ApiError(429, f"the server is busy ({e}); retry shortly",
                                  code="rate_limit_exceeded", kind="rate_limit_error"))
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        obj = "chat.completion" if kind == "chat" else "text_completion"
        if d.get("stream"):
            usage = bool((d.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(_stream(r, events, kind, rid, obj, usage),
                                     media_type="text/event-stream")
        pieces = []
        while True:
            try:
                ev = await asyncio.wait_for(events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    r.cancel()
                    return Response(status_code=499)
                continue
            if ev[0] == "text":
                pieces.append(ev[1])
            elif ev[0] == "error":
                return error(ApiError(400, ev[1]))
            else:
                res = ev[1]
                break
        if kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": res.text},
                      "finish_reason": res.finish_reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": res.text, "finish_reason": res.finish_reason,
                      "logprobs": None}
        out = {"id": rid, "object": obj, "created": int(time.time()), "model": model_id,
               "choices": [choice], "usage": _usage(res)}
        if res.session is not None:
            out["session"] = _session(res)
        return JSONResponse(out)

    async def _stream(r: Request, events, kind, rid, obj, with_usage):
        chunk_obj = obj + ".chunk" if kind == "chat" else obj

        def chunk(delta=None, finish=None, text=None, **extra):
            if kind == "chat":
                choice = {"index": 0, "delta": delta or {}, "finish_reason": finish,
                          "logprobs": None}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish,
                          "logprobs": None}
            c = {"id": rid, "object": chunk_obj, "created": int(time.time()),
                 "model": model_id, "choices": [choice], **extra}
            return f"data: {json.dumps(c)}\n\n"
        try:
            if kind == "chat":
                yield chunk({"role": "assistant", "content": ""})
            while True:
                ev = await events.get()
                if ev[0] == "text":
                    yield chunk({"content": ev[1]}, text=ev[1])
                elif ev[0] == "error":
                    yield f"data: {json.dumps(ApiError(400, ev[1]).body())}\n\n"
                    break
                else:
                    res = ev[1]
                    extra = {"session": _session(res)} if res.session is not None else {}
                    yield chunk(finish=res.finish_reason, **extra)
                    if with_usage:
                        u = {"id": rid, "object": chunk_obj, "created": int(time.time()),
                             "model": model_id, "choices": [], "usage": _usage(res)}
                        yield f"data: {json.dumps(u)}\n\n"
                    break
            yield "data: [DONE]\n\n"
        finally:  # the client gone (the task cancelled) or the answer complete
            r.cancel()

    async def chat_route(request):
        return await complete(request, "chat")

    async def text_route(request):
        return await complete(request, "text")

    async def not_found(request, exc):
        return error(ApiError(404, f"no route {request.method} {request.url.path}"))

    async def server_error(request, exc):
        return error(ApiError(500, f"internal error: {type(exc).__name__}",
                              kind="server_error"))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        thread = threading.Thread(target=engine.run, name="jaxllm-engine", daemon=True)
        thread.start()
        try:
            yield
        finally:
            engine.stop()
            thread.join(timeout=10)

    return Starlette(routes=[Route("/health", health), Route("/v1/models", models),
                             Route("/metrics", metrics),
                             Route("/v1/chat/completions", chat_route, methods=["POST"]),
                             Route("/v1/completions", text_route, methods=["POST"])],
                     exception_handlers={404: not_found, 405: not_found, 500: server_error},
                     lifespan=lifespan)

"""A small proxy for disaggregated prefill/decode with vLLM's ``NixlConnector`` (1P1D, xPyD).

    python -m kvbm_client.tools.disagg_proxy --port 8000 \
        --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

Runs in its own process, beside the engines; it owns no engine state. For each OpenAI request
(``/v1/completions``, ``/v1/chat/completions``) it

1. sends the request to a prefill engine with ``max_tokens=1``, ``stream=false`` and
   ``kv_transfer_params={"do_remote_decode": true, ...}``: the prefill engine computes the prompt
   (its kvbm connector loads what kvbm holds, stores what it computed) and keeps the request's
   blocks for the decode engine to read;
2. takes the ``kv_transfer_params`` of that answer (remote engine id, host, port, block ids,
   request id) and sends the original request with them to a decode engine, which pulls the
   blocks over NIXL and generates; its answer (streamed or not) is relayed as it comes.

Both calls carry the same ``X-Request-Id``. Engines are picked round robin. A prefill that fails
is answered with the prefill engine's status and body (502 when it cannot be reached); the
request never reaches a decode engine without ``kv_transfer_params``.

NOTE: standard library only (a thread per connection, one upstream connection per call), so it
runs wherever kvbm is installed. It is a reference for the protocol and for benchmarks; a
production deployment uses a router (Dynamo's frontend, vLLM's router) that does the same two
calls and chooses engines by load and by KV events (README: "How a router uses KV events").
"""
from __future__ import annotations

import argparse
import itertools
import json
import logging
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator

from ..logs import setup_logging

log = logging.getLogger("kvbm.disagg_proxy")

ROUTES = ("/v1/completions", "/v1/chat/completions")
#: Fields a prefill engine does not accept on a one-token request (vLLM's proxy drops them too).
_PREFILL_DROPPED = ("stream_options", "min_tokens", "min_completion_tokens")
_CHUNK = 64 << 10


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill engine's request: one token, not streamed, asking to keep the KV for a
    remote decode. Pure; ``body`` is not changed."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROPPED}
    out.update(stream=False, max_tokens=1, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None})
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    return out


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    """The decode engine's request: the client's own, plus what the prefill engine answered."""
    return {**body, "kv_transfer_params": kv_transfer_params}


@dataclass
class Upstreams:
    """The engines behind the proxy, each list picked round robin (thread-safe)."""

    prefill: list[str]
    decode: list[str]
    timeout_s: float = 600.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ValueError("at least one prefill and one decode engine are needed")
        self._p: Iterator[str] = itertools.cycle(self.prefill)
        self._d: Iterator[str] = itertools.cycle(self.decode)

    def pick(self) -> tuple[str, str]:
        with self._lock:
            return next(self._p), next(self._d)


class UpstreamError(Exception):
    """An engine answered an error (its status and body are relayed) or could not be reached."""

    def __init__(self, status: int, body: bytes, where: str) -> None:
        super().__init__(f"{where}: HTTP {status}")
        self.status, self.body = status, body


def _post(url: str, body: dict[str, Any], request_id: str, timeout_s: float):
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST", headers={
        "Content-Type": "application/json", "X-Request-Id": request_id})
    try:
        return urllib.request.urlopen(req, timeout=timeout_s)
    except urllib.error.HTTPError as exc:
        raise UpstreamError(exc.code, exc.read(), url) from exc
    except OSError as exc:
        raise UpstreamError(502, json.dumps({"error": f"{url}: {exc}"}).encode(), url) from exc


def run_prefill(url: str, body: dict[str, Any], request_id: str, timeout_s: float) -> dict[str, Any]:
    """POST the prefill request; returns the ``kv_transfer_params`` the engine answered."""
    with _post(url, prefill_body(body), request_id, timeout_s) as resp:
        answer = json.loads(resp.read())
    params = answer.get("kv_transfer_params")
    if not isinstance(params, dict) or not params:
        raise UpstreamError(502, json.dumps({"error": f"{url} answered no kv_transfer_params: is it "
                                             "started with NixlConnector?"}).encode(), url)
    return params


class ProxyHandler(BaseHTTPRequestHandler):
    """One client connection (a thread of :class:`ThreadingHTTPServer`)."""

    server: "ProxyServer"
    protocol_version = "HTTP/1.0"  # the relayed body ends when the connection closes

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        path = self.path.split("?", 1)[0]
        if path not in ROUTES:
            self._answer(404, b'{"error":"not found"}')
            return
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            if not isinstance(body, dict):
                raise ValueError("the body is not a JSON object")
        except ValueError as exc:
            self._answer(400, json.dumps({"error": f"bad JSON: {exc}"}).encode())
            return
        request_id = self.headers.get("X-Request-Id") or uuid.uuid4().hex
        ups = self.server.upstreams
        p_url, d_url = ups.pick()
        t0 = time.perf_counter()
        try:
            params = run_prefill(p_url + path, body, request_id, ups.timeout_s)
            t_prefill = time.perf_counter() - t0
            resp = _post(d_url + path, decode_body(body, params), request_id, ups.timeout_s)
        except UpstreamError as exc:
            log.warning("request %s: %s", request_id, exc)
            self._answer(exc.status, exc.body)
            return
        with resp:
            self.send_response(resp.status)
            self.send_header("Content-Type", resp.headers.get("Content-Type", "application/json"))
            self.end_headers()
            first = None
            while chunk := resp.read1(_CHUNK):
                first = first or time.perf_counter() - t0
                self.wfile.write(chunk)
                self.wfile.flush()
        log.debug("request %s: prefill %s %.1f ms, decode %s first bytes at %.1f ms", request_id, p_url,
                  t_prefill * 1e3, d_url, (first or 0.0) * 1e3)

    def do_GET(self) -> None:  # noqa: N802
        ups = self.server.upstreams
        if self.path == "/health":
            bad = [u for u in ups.prefill + ups.decode if not _healthy(u)]
            self._answer(503 if bad else 200, json.dumps({"unhealthy": bad}).encode())
        elif self.path == "/v1/models":
            try:
                with urllib.request.urlopen(ups.decode[0] + self.path, timeout=10) as resp:
                    self._answer(resp.status, resp.read())
            except OSError as exc:
                self._answer(502, json.dumps({"error": str(exc)}).encode())
        else:
            self._answer(404, b'{"error":"not found"}')

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, fmt: str, *args: Any) -> None:  # access log at debug, not on stderr
        log.debug("%s " + fmt, self.address_string(), *args)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as resp:
            return resp.status == 200
    except OSError:
        return False


class ProxyServer(ThreadingHTTPServer):
    """The proxy's listening socket; ``serve_forever()`` / ``shutdown()`` / ``server_close()``."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], upstreams: Upstreams) -> None:
        super().__init__(address, ProxyHandler)
        self.upstreams = upstreams


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefill", action="append", required=True, help="prefill engine base URL (repeat for xP)")
    p.add_argument("--decode", action="append", required=True, help="decode engine base URL (repeat for yD)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per upstream call")
    args = p.parse_args(argv)
    setup_logging("kvbm-disagg-proxy")
    server = ProxyServer((args.host, args.port), Upstreams(
        [u.rstrip("/") for u in args.prefill], [u.rstrip("/") for u in args.decode], args.timeout))
    log.info("disagg proxy on %s:%d: prefill %s, decode %s", args.host, server.server_address[1], args.prefill,
             args.decode)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

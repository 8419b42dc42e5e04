"""The 1P1D proxy (``kvbm_client.tools.disagg_proxy``): its request rewriting (pure) and, through
real sockets, the two calls it makes. The engines here are stand-ins (small HTTP servers that
record what they receive and answer as vLLM's OpenAI server does); the proxy in front of real
vLLM engines is exercised by ``test_1p1d_cpu.py``.
"""
from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvbm_client.tools.disagg_proxy import ProxyServer, Upstreams, decode_body, prefill_body

KV_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p-engine",
             "remote_request_id": "cmpl-1", "remote_block_ids": [3, 4], "remote_host": "127.0.0.1",
             "remote_port": 5600, "tp_size": 1}


def test_prefill_body_asks_for_one_token_and_a_remote_decode():
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 50, "stream": True, "min_tokens": 4,
            "stream_options": {"include_usage": True}, "max_completion_tokens": 50, "temperature": 0.0}
    out = prefill_body(body)
    assert out["max_tokens"] == 1 and out["max_completion_tokens"] == 1 and out["stream"] is False
    assert out["kv_transfer_params"]["do_remote_decode"] is True
    assert out["kv_transfer_params"]["do_remote_prefill"] is False
    assert "stream_options" not in out and "min_tokens" not in out
    assert out["prompt"] == [1, 2, 3] and out["temperature"] == 0.0
    assert body["max_tokens"] == 50 and "kv_transfer_params" not in body, "the client's body was changed"


def test_decode_body_is_the_clients_request_with_the_prefill_answer():
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 50, "stream": True}
    assert decode_body(body, KV_PARAMS) == {**body, "kv_transfer_params": KV_PARAMS}


class StandInEngine(ThreadingHTTPServer):
    """Answers POSTs like a vLLM OpenAI server would, and records every body it got."""

    daemon_threads = True

    def __init__(self, answer_status: int = 200, kv_params: dict | None = KV_PARAMS) -> None:
        self.bodies: list[dict] = []
        self.headers_seen: list[dict] = []
        self.answer_status, self.kv_params = answer_status, kv_params
        super().__init__(("127.0.0.1", 0), _StandInHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _StandInHandler(BaseHTTPRequestHandler):
    server: StandInEngine

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        self.server.headers_seen.append(dict(self.headers))
        if self.server.answer_status != 200:
            self._send(self.server.answer_status, b'{"error":"engine says no"}')
        elif body.get("stream"):
            chunks = [{"choices": [{"text": "a", "token_ids": [7]}]}, {"choices": [{"text": "b", "token_ids": [8]}]}]
            self._send(200, b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
                       + b"data: [DONE]\n\n", "text/event-stream")
        else:
            answer = {"choices": [{"text": "a"}]}
            if self.server.kv_params is not None:
                answer["kv_transfer_params"] = self.server.kv_params
            self._send(200, json.dumps(answer).encode())

    def _send(self, status: int, data: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def deploy():
    servers: list = []

    def make(prefill: StandInEngine, decode: StandInEngine) -> str:
        proxy = ProxyServer(("127.0.0.1", 0), Upstreams([prefill.url], [decode.url], timeout_s=10))
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        servers.extend([proxy, prefill, decode])
        return f"http://127.0.0.1:{proxy.server_address[1]}"

    yield make
    for s in servers:
        s.shutdown()
        s.server_close()


def _post(url: str, body: dict) -> tuple[int, bytes]:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_prefill_then_decode_with_its_kv_params_and_the_stream_relayed(deploy):
    prefill, decode = StandInEngine(), StandInEngine()
    url = deploy(prefill, decode)
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 5, "stream": True}
    status, data = _post(url, body)
    assert status == 200
    assert data.count(b"data: ") == 3 and data.endswith(b"data: [DONE]\n\n"), data
    assert prefill.bodies == [prefill_body(body)]
    assert decode.bodies == [decode_body(body, KV_PARAMS)]
    p_id = prefill.headers_seen[0]["X-Request-Id"]
    assert p_id and decode.headers_seen[0]["X-Request-Id"] == p_id


def test_a_failed_prefill_is_answered_and_never_decoded(deploy):
    prefill, decode = StandInEngine(answer_status=400), StandInEngine()
    status, data = _post(deploy(prefill, decode), {"model": "m", "prompt": [1], "max_tokens": 5})
    assert status == 400 and b"engine says no" in data
    assert decode.bodies == []


def test_a_prefill_engine_without_nixl_is_a_502(deploy):
    prefill, decode = StandInEngine(kv_params=None), StandInEngine()
    status, data = _post(deploy(prefill, decode), {"model": "m", "prompt": [1], "max_tokens": 5})
    assert status == 502 and b"kv_transfer_params" in data
    assert decode.bodies == []


def test_an_unreachable_prefill_engine_is_a_502(deploy):
    gone = StandInEngine()
    gone.shutdown()
    gone.server_close()
    decode = StandInEngine()
    status, _ = _post(deploy(gone, decode), {"model": "m", "prompt": [1], "max_tokens": 5})
    assert status == 502
    assert decode.bodies == []


def test_bad_json_and_unknown_routes(deploy):
    url = deploy(StandInEngine(), StandInEngine())
    req = urllib.request.Request(url + "/v1/completions", data=b"{not json", headers={"Content-Type": "x"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 400
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(urllib.request.Request(url + "/v1/embeddings", data=b"{}"), timeout=10)
    assert err.value.code == 404


def test_round_robin_over_engines():
    ups = Upstreams(["p0", "p1"], ["d0"])
    assert [ups.pick() for _ in range(3)] == [("p0", "d0"), ("p1", "d0"), ("p0", "d0")]
    with pytest.raises(ValueError):
        Upstreams([], ["d0"])

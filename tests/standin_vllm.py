"""Stand-ins for a ``vllm serve`` process on 127.0.0.1, for the CPU tests of the weight-sync watchdog and the
preflight: one that accepts and never answers, and one that answers TRL's GETs as a server does and never answers a
POST. Both are bounded: ``close()`` releases whatever they hold.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class SilentServer:
    """Accepts TCP connections on 127.0.0.1 and never answers (a hung server, or a firewall that accepts):
    ``requests`` without a timeout waits on it forever. Records when the first connection came."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.first_accept: float | None = None
        self.held: list[socket.socket] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            if self.first_accept is None:
                self.first_accept = time.monotonic()
            self.held.append(conn)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        for conn in self.held:
            conn.close()
        self.sock.close()


# What `vllm serve` answers to the GETs TRL's client and the preflight send (model "tiny", one worker).
GET_ROUTES: dict[str, Any] = {
    "/health": {},
    "/v1/models": {"object": "list", "data": [{"id": "tiny", "root": "tiny", "object": "model"}]},
    "/get_world_size": {"world_size": 1},
    "/version": {"version": "0.26.0"},
}


class GetOnlyServer(ThreadingHTTPServer):
    """Answers TRL's GETs (/health, /v1/models) as ``vllm serve`` does, never answers a POST (the weight update's
    requests): a server that died or hung between two rollouts. Records when the first POST arrived."""

    daemon_threads = True

    def __init__(self, routes: dict[str, Any] | None = None, handler: type | None = None) -> None:
        self.release = threading.Event()
        self.first_post: float | None = None
        # GET path -> JSON body (200); any other path answers 404, as vLLM's server does
        self.routes = dict(GET_ROUTES if routes is None else routes)
        super().__init__(("127.0.0.1", 0), handler or _GetOnlyHandler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.release.set()
        self.shutdown()
        self.server_close()


class _GetOnlyHandler(BaseHTTPRequestHandler):
    server: GetOnlyServer

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = self.server.routes.get(self.path)
        data = json.dumps(body if body is not None else {"detail": "Not Found"}).encode()
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:  # noqa: N802
        if self.server.first_post is None:
            self.server.first_post = time.monotonic()
        self.server.release.wait(120)  # bounded: the test's teardown releases it


class OneRolloutServer(GetOnlyServer):
    """``vllm serve`` as TRL's server-mode client sees it, for one rollout: the GETs (and ``/server_info``, which TRL
    reads for the log-prob mode), ``/reset_prefix_cache``, and one generation request (``/v1/completions``) answered
    with ``answer`` (token ids) for every completion, each token at log-prob -1. Every later generation request is
    accepted and never answered: a server whose engine hung between two rollouts. ``on_stall`` runs when the first
    unanswered request arrives (recorded in ``stalled_at``); a held request waits at most 120 s for ``close()``."""

    def __init__(self, answer: list[int], on_stall: Any = None) -> None:
        routes = {**GET_ROUTES, "/server_info?config_format=json": {"vllm_config": {
            "model_config": {"logprobs_mode": "processed_logprobs"}, "weight_transfer_config": {"backend": "nccl"}}}}
        self.answer, self.on_stall = list(answer), on_stall
        self.rollouts = 0
        self.stalled_at: float | None = None
        super().__init__(routes, _OneRolloutHandler)


class _OneRolloutHandler(_GetOnlyHandler):
    server: OneRolloutServer

    def _reply(self, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:  # noqa: N802
        request = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        if self.path == "/reset_prefix_cache":
            self._reply({"success": True})
            return
        if self.path != "/v1/completions":
            self._reply({})
            return
        server = self.server
        server.rollouts += 1
        if server.rollouts > 1:  # accepted, never answered
            if server.stalled_at is None:
                server.stalled_at = time.monotonic()
                if server.on_stall is not None:
                    server.on_stall()
            server.release.wait(120)
            return
        tokens = server.answer[: request["max_tokens"]]
        logprobs = {"tokens": [f"token_id:{t}" for t in tokens], "token_logprobs": [-1.0] * len(tokens),
                    "top_logprobs": [None] * len(tokens)}
        self._reply({"choices": [{"prompt_token_ids": prompt, "token_ids": tokens, "logprobs": logprobs}
                                 for prompt in request["prompt"] for _ in range(request["n"])]})

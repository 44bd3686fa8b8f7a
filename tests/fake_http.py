"""Scripted HTTP workers for the router's tests: a handler base with a JSON answer and no
logging, and a loopback server on a thread of its own, stopped by the test."""
from __future__ import annotations

import http.server
import json
import threading


class JsonHandler(http.server.BaseHTTPRequestHandler):
    def send_json(self, body: object, status: int = 200) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a: object) -> None:
        pass


class FakeServer:
    """Serves `handler` on 127.0.0.1 (a free port) until stop()."""

    def __init__(self, handler: type[JsonHandler]) -> None:
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def ready(role: str, block_tokens: int, **extra: object) -> dict:
    """A worker's /kvtier/load answer: ready, with a node address nobody listens on."""
    return {"role": role, "status": "ready", "node": "127.0.0.1:1", "block_tokens": block_tokens, **extra}

"""``lora_guard.demo.testing.closed_loop``: the integration tests' HTTP clients in a closed loop."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from lora_guard.demo.testing import closed_loop


class Echo(BaseHTTPRequestHandler):
    in_flight = 0
    most_in_flight = 0
    lock = threading.Lock()

    def do_GET(self) -> None:
        with Echo.lock:
            Echo.in_flight += 1
            Echo.most_in_flight = max(Echo.most_in_flight, Echo.in_flight)
        body = self.path.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        threading.Event().wait(0.01)
        with Echo.lock:
            Echo.in_flight -= 1
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def url() -> Iterator[str]:
    Echo.most_in_flight = 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_every_item_is_sent_once_by_at_most_that_many_clients(url: str) -> None:
    items = list(range(30))
    answers = closed_loop(url, items, lambda http, i: http.get(f"/{i}").text, clients=3)
    assert answers == [f"/{i}" for i in items]  # in the items' order
    assert 1 < Echo.most_in_flight <= 3


def test_an_error_in_a_client_is_raised_to_the_caller(url: str) -> None:
    def send(http: httpx.Client, i: int) -> str:
        if i == 5:
            raise AssertionError("item 5 went wrong")
        return http.get(f"/{i}").text

    with pytest.raises(AssertionError, match="item 5 went wrong"):
        closed_loop(url, list(range(20)), send, clients=2)

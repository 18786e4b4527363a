"""The dashboard's web server: one page, its assets, and a server-sent event stream of the run's state.

Tornado, because it is one well-kept package with no dependencies of its own that has everything this needs: an HTTP
server, static files, and coroutine handlers that keep a long-lived event stream open per browser without a thread
each. It runs its own event loop in a daemon thread of the server process; that thread only reads the run directory
(server/dashboard/view.py), so a slow or stuck browser holds up at most its own stream, never a round.

Access: on a loopback address no token is asked for, but the Host header must name a loopback host (so that a web page
elsewhere cannot reach it by DNS rebinding). On any other address a random token is made and printed at start, like
Jupyter's; a request must carry it (``?token=``, an ``Authorization: token ...`` header, or the cookie set when the
page was opened with it) or it is refused with 403.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import secrets
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tornado.web
from tornado.httpserver import HTTPServer
from tornado.iostream import StreamClosedError
from tornado.netutil import bind_sockets

from server.config import ConfigError
from server.dashboard.view import TIMELINE_FILE, RunView

STATIC_DIR = Path(__file__).parent / "static"
POLL_S = 0.5  # how often each stream looks at the run directory
HEARTBEAT_S = 10.0  # a stream with no news still sends the server's clock this often
STREAM_END_S = 2.0  # the longest the run's end waits for a stream to send its last message (a stalled browser's)
FLAG = "--dashboard"
#: Only the page's own files; nothing from elsewhere (the page loads nothing from the internet).
CSP = "default-src 'self'; img-src 'self'; style-src 'self'; script-src 'self'; connect-src 'self'"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Address:
    """Where the dashboard listens, and the token that guards it (None on loopback)."""

    host: str
    port: int
    token: str | None

    @classmethod
    def parse(cls, text: str, flag: str = FLAG) -> Address:
        """``HOST:PORT`` (``[::1]:8050`` for IPv6; port 0 for a free one) given to ``flag``; a token unless HOST is
        loopback."""
        host, sep, port = text.rpartition(":")
        host = host.strip("[]")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ConfigError(f"{flag} expects HOST:PORT, e.g. {flag} 127.0.0.1:8050; got {text!r}")
        return cls(host, int(port), None if is_loopback(host) else secrets.token_urlsafe(24))

    def url(self, port: int) -> str:
        host = socket.gethostname() if self.host in ("0.0.0.0", "::") else self.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{port}/" + (f"?token={self.token}" if self.token else "")


class _Handler(tornado.web.RequestHandler):
    """Every route: the access check first, and the page's content policy."""

    def prepare(self) -> None:
        self.set_header("Content-Security-Policy", CSP)
        self.set_header("X-Content-Type-Options", "nosniff")
        address: Address = self.settings["address"]
        if address.token is None:
            host = self.request.host_name.strip("[]")
            if not is_loopback(host):
                raise tornado.web.HTTPError(403, reason="Host is not a loopback name")
            return
        cookie = f"edgefl-dashboard-{self.settings['port']}"
        header = self.request.headers.get("Authorization", "")
        given = self.get_query_argument("token", None) or header.removeprefix("token ") or self.get_cookie(cookie)
        # as bytes: compare_digest raises on a str that is not ASCII (a 500 and a traceback for ?token=%C3%A9)
        if not given or not secrets.compare_digest(given.encode("utf-8", "replace"), address.token.encode()):
            raise tornado.web.HTTPError(403, reason="token required: open the address printed at start")
        self.set_cookie(cookie, address.token, httponly=True, samesite="Strict")

    def set_default_headers(self) -> None:
        self.set_header("Cache-Control", "no-store")


class _PageHandler(_Handler):
    def get(self) -> None:
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.write((STATIC_DIR / "index.html").read_bytes())


class _StaticHandler(_Handler, tornado.web.StaticFileHandler):
    pass


class _StateHandler(_Handler):
    """The state once, as JSON (for scripts and ``curl``)."""

    def get(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.write(_message(self.settings["view"].snapshot()))


class _TimelineHandler(_Handler):
    """The run's timeline.png (written by the run, when it writes one), and no other file of the run directory."""

    def get(self) -> None:
        path = self.settings["view"].run_dir / TIMELINE_FILE
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise tornado.web.HTTPError(404) from exc
        self.set_header("Content-Type", "image/png")
        self.write(data)


class _EventsHandler(_Handler):
    """Server-sent events: the state whenever a file of the run changed, the server's clock at least every 10 s."""

    async def get(self) -> None:
        self.set_header("Content-Type", "text/event-stream")
        streams: set[asyncio.Future[None]] = self.settings["streams"]
        done = asyncio.get_running_loop().create_future()
        streams.add(done)
        try:
            await self._stream()
        finally:
            streams.discard(done)
            done.set_result(None)

    async def _stream(self) -> None:
        view: RunView = self.settings["view"]
        stopping: asyncio.Event = self.settings["stopping"]
        sent, sent_at = None, 0.0
        while True:
            if stopping.is_set():  # the run ended: say so, so the page stops waiting for news that will not come
                with contextlib.suppress(StreamClosedError):
                    self.write(b"data: " + _message(view.snapshot(), ended=True) + b"\n\n")
                    await self.flush()
                return
            state = view.snapshot()
            if state is not sent or time.monotonic() - sent_at > HEARTBEAT_S:
                try:
                    self.write(b"data: " + _message(state) + b"\n\n")
                    await self.flush()  # a browser that stops reading stalls this stream only
                except StreamClosedError:
                    return
                sent, sent_at = state, time.monotonic()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stopping.wait(), POLL_S)


def _message(state: bytes, *, ended: bool = False) -> bytes:
    """The state with the server's wall clock, which the page counts elapsed time and 'last seen' on; ``ended``: the
    last message, the dashboard server stops with the run."""
    return b'{"now": %.3f, "ended": %s, "state": %s}' % (time.time(), b"true" if ended else b"false", state)


class DashboardServer:
    """The dashboard of ``run_dir`` on ``address``, served from a daemon thread until :meth:`stop`."""

    def __init__(self, run_dir: Path, address: Address, facts: dict[str, Any] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.address = address
        self.facts = facts
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> DashboardServer:
        """Bind (here, so that a port in use fails now and says so), then serve in the background."""
        try:
            sockets = bind_sockets(self.address.port, self.address.host)
        except OSError as exc:
            raise ConfigError(
                f"{FLAG} {self.address.host}:{self.address.port}: cannot listen there ({exc.strerror}); choose "
                f"another port, or port 0 for a free one"
            ) from exc
        self.port = sockets[0].getsockname()[1]
        logging.getLogger("tornado.access").setLevel(logging.WARNING)  # refused requests only, not every page view
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(sockets),), daemon=True)
        self._thread.name = "edgefl-dashboard"
        self._thread.start()
        self._ready.wait()
        return self

    @property
    def url(self) -> str:
        return self.address.url(self.port)

    async def _serve(self, sockets: list[socket.socket]) -> None:
        self._loop, self._stopping = asyncio.get_running_loop(), asyncio.Event()
        app = tornado.web.Application(
            [
                (r"/", _PageHandler),
                (r"/events", _EventsHandler),
                (r"/state", _StateHandler),
                (r"/timeline\.png", _TimelineHandler),
                (r"/static/(.*)", _StaticHandler, {"path": str(STATIC_DIR)}),
            ],
            address=self.address,
            port=self.port,
            view=RunView(self.run_dir, self.facts),
            stopping=self._stopping,
            streams=(streams := set()),
        )
        server = HTTPServer(app)
        server.add_sockets(sockets)
        self._ready.set()
        await self._stopping.wait()
        server.stop()
        if streams:  # let every stream send its last message, that the run ended
            await asyncio.wait(set(streams), timeout=STREAM_END_S)
        await server.close_all_connections()

    def stop(self) -> None:
        if self._loop is not None and self._stopping is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
            self._thread.join(timeout=10)


def announce(server: DashboardServer) -> None:
    """The address on a line of its own (with the token, when there is one), to copy into a browser."""
    guard = "; not on loopback: requests must carry the token in this address" if server.address.token else ""
    print(f"dashboard of {server.run_dir}{guard}:\n    {server.url}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def serve_dashboard(
    address: str | None, run_dir: Path, facts: dict[str, Any] | None = None
) -> Iterator[DashboardServer | None]:
    """``--dashboard HOST:PORT`` for the length of a run, heading the page with ``facts`` (``run_facts``) from the
    start; nothing when the flag was not given."""
    if not address:
        yield None
        return
    server = DashboardServer(run_dir, Address.parse(address), facts).start()
    announce(server)
    try:
        yield server
    finally:
        server.stop()

"""``--metrics HOST:PORT``: serve ``/metrics`` in the Prometheus text format for the length of a run.

prometheus-client's WSGI app renders the families (server/fleet_metrics.py) on a thread of its own, so a scrape never
holds up a round. Access is the dashboard's rule (server/dashboard/server.py): on a loopback address no token, but
the Host header must name a loopback host (no DNS rebinding); on any other address a token that every request must
carry as ``Authorization: Bearer TOKEN`` (what Prometheus's ``authorization`` setting sends) or ``?token=``. The token
is ``EDGEFL_METRICS_TOKEN`` when set, so that Prometheus's configuration keeps working across runs, else a random one
printed at start.

A run's last round would be lost if the server quit before Prometheus scraped again, so when the run ends and
someone has been scraping, the server waits for one more complete scrape (at most ``LAST_SCRAPE_WAIT_S``; Ctrl-C
ends the wait).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import sys
import threading
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.process_collector import ProcessCollector

from server.config import ConfigError
from server.dashboard.server import Address, is_loopback
from server.fleet_metrics import FleetMetrics
from server.target import Target

if TYPE_CHECKING:
    from server.orchestrator import RoundObserver

FLAG = "--metrics"
TOKEN_ENV = "EDGEFL_METRICS_TOKEN"
LAST_SCRAPE_WAIT_S = 60.0  # Prometheus's default scrape interval is one minute
METRICS_HELP = (
    "serve Prometheus metrics of the run at http://HOST:PORT/metrics (docs/monitoring.md); an address that is not "
    f"loopback needs a token: ${TOKEN_ENV}, or a random one printed at start"
)


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scraper that stalls cannot keep the server process alive


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # one line per scrape on the console: no
        pass


class _Done:
    """A response body whose ``close`` (called by the server once the body is written) reports the scrape served."""

    def __init__(self, body: Iterable[bytes], on_close: Callable[[], None]) -> None:
        self.body, self.on_close = body, on_close

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.body)

    def close(self) -> None:
        self.on_close()


class MetricsEndpoint:
    """``/metrics`` of ``registry`` on ``address`` until :meth:`stop`; :meth:`last_scrape` waits for a final one."""

    def __init__(self, address: Address, registry: CollectorRegistry) -> None:
        self.address = address
        self._app = make_wsgi_app(registry)
        self._served = threading.Condition()
        self._scrapes = 0  # complete scrapes
        self._final_scrapes = 0  # complete scrapes that started after the run ended
        self._ended = False
        self._httpd: WSGIServer | None = None

    def start(self) -> MetricsEndpoint:
        family = socket.AF_INET6 if ":" in self.address.host else socket.AF_INET
        server_class = type("_MetricsServer", (_Server,), {"address_family": family})
        try:
            self._httpd = make_server(self.address.host, self.address.port, self._serve, server_class, _Quiet)
        except OSError as exc:
            raise ConfigError(
                f"{FLAG} {self.address.host}:{self.address.port}: cannot listen there ({exc.strerror}); choose "
                "another port, or port 0 for a free one"
            ) from exc
        threading.Thread(target=self._httpd.serve_forever, name="edgefl-metrics", daemon=True).start()
        return self

    @property
    def port(self) -> int:
        return self._httpd.server_address[1] if self._httpd else 0

    @property
    def url(self) -> str:
        return self.address.url(self.port).split("?")[0] + "metrics"

    def _serve(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if not self._allowed(environ):
            start_response("403 Forbidden", [("Content-Type", "text/plain")])
            return [b"token required (Authorization: Bearer TOKEN), or a loopback Host on a loopback address\n"]
        with self._served:
            final = self._ended
        return _Done(self._app(environ, start_response), lambda: self._count(final))

    def _allowed(self, environ: dict[str, Any]) -> bool:
        token = self.address.token
        if token is None:
            host = environ.get("HTTP_HOST", "")
            host = host[1:].partition("]")[0] if host.startswith("[") else host.partition(":")[0]
            return is_loopback(host)
        header = environ.get("HTTP_AUTHORIZATION", "")
        query = urllib.parse.parse_qs(environ.get("QUERY_STRING", ""))
        given = header.removeprefix("Bearer ") if header.startswith("Bearer ") else query.get("token", [""])[0]
        return secrets.compare_digest(given.encode("utf-8", "replace"), token.encode())

    def _count(self, final: bool) -> None:
        with self._served:
            self._scrapes += 1
            self._final_scrapes += final
            self._served.notify_all()

    @property
    def scraped(self) -> bool:
        with self._served:
            return self._scrapes > 0

    def last_scrape(self, timeout: float = LAST_SCRAPE_WAIT_S) -> bool | None:
        """The run has ended: wait for a scrape that starts from here. None when nobody has scraped (nothing to
        wait for), else whether one came within ``timeout``."""
        with self._served:
            self._ended = True
            if self._scrapes == 0:
                return None
            return self._served.wait_for(lambda: self._final_scrapes > 0, timeout)

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()


def metrics_address(text: str) -> Address:
    """``HOST:PORT`` as the dashboard parses it; off loopback the token is ``$EDGEFL_METRICS_TOKEN`` when set."""
    address = Address.parse(text, flag=FLAG)
    fixed = os.environ.get(TOKEN_ENV)
    return replace(address, token=fixed) if address.token and fixed else address


@contextlib.contextmanager
def serve_metrics(
    address: str | None, run_dir: Path, target: Target, algorithm: str, observer: RoundObserver
) -> Iterator[RoundObserver]:
    """The run's observer: ``observer`` itself without ``--metrics``; else the exporter, which hands every call on to
    it, served until the run is over (and scraped once more, when someone scrapes)."""
    if not address:
        yield observer
        return
    fleet = FleetMetrics(run_dir, target, algorithm, observer)
    registry = CollectorRegistry()
    registry.register(fleet)
    registry.register(ProcessCollector(registry=None))  # the server's own CPU and memory
    endpoint = MetricsEndpoint(metrics_address(address), registry).start()
    guard = "; not on loopback: Prometheus must send the token" if endpoint.address.token else ""
    token = f"\n    token: {endpoint.address.token}" if endpoint.address.token and not os.environ.get(TOKEN_ENV) else ""
    print(f"Prometheus metrics of {run_dir}{guard}:\n    {endpoint.url}{token}", file=sys.stderr, flush=True)
    try:
        yield fleet
        if endpoint.scraped:
            print(f"waiting for Prometheus's last scrape of {endpoint.url} (at most {LAST_SCRAPE_WAIT_S:.0f} s; "
                  "Ctrl-C ends the wait)", file=sys.stderr, flush=True)  # fmt: skip
        with contextlib.suppress(KeyboardInterrupt):
            endpoint.last_scrape()
    finally:
        endpoint.stop()

"""The store's metrics in Prometheus text format, and a tiny HTTP endpoint serving them.

`render(store.metrics())` gives the exposition text; `serve_metrics(store.metrics)` serves
it at `http://127.0.0.1:<port>/metrics` from a daemon thread (standard library only).
"""

from __future__ import annotations

import http.server
import itertools
import threading
from collections.abc import Callable
from typing import Any


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(**labels: str) -> str:
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items()) + "}" if labels else ""


def render(metrics: dict[str, Any]) -> str:
    """Prometheus text exposition (version 0.0.4) of `Store.metrics()`."""
    out: dict[str, tuple[str, str, list[str]]] = {}

    def add(name: str, kind: str, help_text: str, value: float, **labels: str) -> None:
        out.setdefault(name, (kind, help_text, []))[2].append(f"{name}{_labels(**labels)} {value}")

    add("tidal_store_version", "gauge", "Current policy version.", metrics["version"])
    for partition, p in metrics["partitions"].items():
        add("tidal_store_rows", "gauge", "Rows held (not yet evicted).", p["rows"], partition=partition)
        add("tidal_store_bytes", "gauge", "Bytes held.", p["bytes"], partition=partition)
        add("tidal_store_evicted_total", "counter", "Rows evicted after every consumer acked them.", p["evicted"], partition=partition)
        for column, n in p["ready_by_column"].items():
            add("tidal_store_column_rows", "gauge", "Rows that have this column.", n, partition=partition, column=column)
        for consumer, c in p["consumers"].items():
            labels = {"partition": partition, "consumer": consumer}
            add("tidal_store_acked_total", "counter", "Rows acked by the consumer.", c["acked"], **labels)
            add("tidal_store_leased", "gauge", "Rows leased to the consumer and not yet acked.", c["leased"], **labels)
            add("tidal_store_dropped_total", "counter", "Rows a sampler dropped for the consumer (e.g. too stale).", c["dropped"], **labels)
            add("tidal_store_redelivered_total", "counter", "Leases that expired or were released.", c["redelivered"], **labels)
            for columns, n in c["ready"].items():
                add("tidal_store_ready", "gauge", "Rows ready for the consumer's column set.", n, columns=columns, **labels)
            wait = c["wait_s"]
            cumulative = itertools.accumulate(wait["buckets"].values())
            for le, n in zip(wait["buckets"], cumulative):
                le = "+Inf" if le == "inf" else le
                add("tidal_store_get_wait_seconds_bucket", "histogram", "Time get calls waited for rows.", n, le=le, **labels)
            add("tidal_store_get_wait_seconds_sum", "histogram", "", wait["sum"], **labels)
            add("tidal_store_get_wait_seconds_count", "histogram", "", wait["count"], **labels)
    lines = []
    for name, (kind, help_text, samples) in out.items():
        if help_text:
            family = name.removesuffix("_bucket")
            lines += [f"# HELP {family} {help_text}", f"# TYPE {family} {kind}"]
        lines += samples
    return "\n".join(lines) + "\n"


class MetricsServer:
    """Serves `render(source())` at /metrics; `port` is the bound port."""

    def __init__(self, source: Callable[[], dict[str, Any]], *, host: str = "127.0.0.1", port: int = 0) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # http.server's naming
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404, "only /metrics is served")
                    return
                body = render(source()).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # quiet scrapes
                pass

        self._httpd = http.server.ThreadingHTTPServer((host, port), Handler)
        self.port: int = self._httpd.server_address[1]
        self.url = f"http://{host}:{self.port}/metrics"
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="tidal-store-metrics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def serve_metrics(source: Callable[[], dict[str, Any]], *, host: str = "127.0.0.1", port: int = 0) -> MetricsServer:
    return MetricsServer(source, host=host, port=port)

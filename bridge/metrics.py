"""The bridge's own Prometheus metrics, and the engine's, on one `GET /metrics`."""

from __future__ import annotations

import httpx
from prometheus_client import CollectorRegistry, Counter, generate_latest

ENGINE_SCRAPE_TIMEOUT_S = 2.0


class BridgeMetrics:
    """HTTP responses by route and status code, in the bridge's own registry.

    Args:
        engine_metrics_url: the engine's Prometheus endpoint (e.g. http://127.0.0.1:9400/metrics),
            appended to the bridge's own output; None to show only the bridge's metrics.
    """

    def __init__(self, engine_metrics_url: str | None = None) -> None:
        self.registry = CollectorRegistry()
        self.engine_metrics_url = engine_metrics_url
        self.responses = Counter("genserve_bridge_http_responses", "HTTP responses sent by the bridge.",
                                 ["route", "code"], registry=self.registry)
        self.engine_scrape_errors = Counter("genserve_bridge_engine_scrape_errors",
                                            "Failed reads of the engine's metrics endpoint.",
                                            registry=self.registry)

    async def exposition(self) -> bytes:
        """Prometheus text format: the bridge's metrics, then the engine's (if reachable)."""
        engine_text = b""
        if self.engine_metrics_url:
            try:
                async with httpx.AsyncClient(timeout=ENGINE_SCRAPE_TIMEOUT_S) as client:
                    reply = await client.get(self.engine_metrics_url)
                    reply.raise_for_status()
                    engine_text = reply.content
            except httpx.HTTPError:
                self.engine_scrape_errors.inc()
        return generate_latest(self.registry) + engine_text

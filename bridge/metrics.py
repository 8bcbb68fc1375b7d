"""The bridge's own Prometheus metrics, and the engines', on one `GET /metrics`.

Both the bridge and every engine export the standard `process_*` series; each process labels
them `component="bridge"` or `component="engine"` (`genserve.common.process_metrics`), and with several
engines each engine sample also gets a `replica` label, so every family is declared once and
every process's series stay apart.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Iterator, Sequence

import httpx
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from genserve.common.process_metrics import ComponentProcessCollector

ENGINE_SCRAPE_TIMEOUT_S = 2.0
REPLICA_LABEL = "replica"


class BridgeMetrics:
    """HTTP responses by route and status code and the bridge process's `process_*` series
    (`component="bridge"`), in the bridge's own registry.

    Args:
        engine_metrics_url: the engines' Prometheus endpoints (e.g. http://127.0.0.1:9400/metrics),
            appended to the bridge's own output: one URL (a string or a one-item sequence) is
            appended as it is; with several, every engine sample gets a `replica` label, the
            URL's position in the sequence ("0", "1", ...), so the series stay distinct. None
            or empty to show only the bridge's metrics.
    """

    def __init__(self, engine_metrics_url: str | Sequence[str] | None = None) -> None:
        self.registry = CollectorRegistry()
        if isinstance(engine_metrics_url, str):
            engine_metrics_url = [engine_metrics_url]
        self.engine_metrics_urls: list[str] = list(engine_metrics_url or ())
        # One TLS context for every scrape: httpx builds a new one (loading the CA bundle, ~40 ms
        # of this event loop, which every open stream waits on) for each client made without one,
        # and the console reads /metrics every 2 s. Certificates are still verified for https URLs.
        self._tls = ssl.create_default_context() if self.engine_metrics_urls else None
        self.responses = Counter("genserve_bridge_http_responses", "HTTP responses sent by the bridge.",
                                 ["route", "code"], registry=self.registry)
        self.engine_scrape_errors = Counter("genserve_bridge_engine_scrape_errors",
                                            "Failed reads of the engine's metrics endpoint.",
                                            registry=self.registry)
        self.registry.register(ComponentProcessCollector("bridge"))

    async def exposition(self) -> bytes:
        """Prometheus text format: the bridge's metrics and the engines' (those reachable), each
        family declared once (the `process_*` families hold the bridge's and the engines'
        samples)."""
        if not self.engine_metrics_urls:
            return generate_latest(self.registry)
        texts = await self.scrape_engines()
        merged = CollectorRegistry()
        merged.register(_MergedCollector(list(self.registry.collect()), texts, label_replicas=len(texts) > 1))
        return generate_latest(merged)

    async def scrape_engines(self) -> list[bytes | None]:
        """Each engine's exposition, in `engine_metrics_urls` order, read concurrently (at most
        ENGINE_SCRAPE_TIMEOUT_S seconds each); None where an engine was unreachable or answered
        an HTTP error (counted in engine_scrape_errors). Empty without URLs.

        Raises:
            httpx.InvalidURL: a configured URL is malformed (an operator's error, not a request's).
        """
        if not self.engine_metrics_urls:
            return []
        async with httpx.AsyncClient(timeout=ENGINE_SCRAPE_TIMEOUT_S, verify=self._tls) as client:
            return list(await asyncio.gather(*(self._scrape(client, url) for url in self.engine_metrics_urls)))

    async def _scrape(self, client: httpx.AsyncClient, url: str) -> bytes | None:
        """One engine's exposition, or None (counted in engine_scrape_errors) when unreachable."""
        try:
            reply = await client.get(url)
            reply.raise_for_status()
            return reply.content
        except httpx.HTTPError:
            self.engine_scrape_errors.inc()
            return None


class _MergedCollector:
    """The bridge's families and the engines' expositions as one: each family once.

    Args:
        own: the bridge's own families (unchanged).
        texts: each engine's exposition, None where the engine was unreachable (it adds nothing).
        label_replicas: give every engine sample a `replica` label, its index in `texts`.
    """

    def __init__(self, own: list[Metric], texts: Sequence[bytes | None], *, label_replicas: bool) -> None:
        self.own = own
        self.texts = texts
        self.label_replicas = label_replicas

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for family in self.own:
            families[family.name] = merged = Metric(family.name, family.documentation, family.type, family.unit)
            merged.samples = list(family.samples)
        for replica, text in enumerate(self.texts):
            if text is None:
                continue
            extra = {REPLICA_LABEL: str(replica)} if self.label_replicas else {}
            for family in text_string_to_metric_families(text.decode()):
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation,
                                                            family.type, family.unit)
                merged.samples += [Sample(s.name, {**s.labels, **extra}, s.value, s.timestamp, s.exemplar)
                                   for s in family.samples]
        yield from families.values()

"""The standard `process_*` Prometheus series of one genserve process, labelled by component.

prometheus-client's `ProcessCollector` reads /proc/self (Linux): resident and virtual memory
(bytes), CPU time (s), open and maximum file descriptors, start time (Unix s). genserve's bridge
shows its own series and the engines' on one `GET /metrics`, so each process's series carry a
`component` label ("engine" or "bridge") and stay distinct; the names are the standard ones that
dashboards and alerts expect. Imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import ProcessCollector
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

COMPONENT_LABEL = "component"


class ComponentProcessCollector(Collector):
    """This process's `process_*` series with `component="<component>"` on every sample.

    Args:
        component: the label value, "engine" or "bridge".

    Outside Linux (no /proc) it yields nothing, as `ProcessCollector` does.
    """

    def __init__(self, component: str) -> None:
        self.component = component
        self._process = ProcessCollector(registry=None)

    def collect(self) -> Iterator[Metric]:
        for family in self._process.collect():
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            labelled.samples = [Sample(s.name, {**s.labels, COMPONENT_LABEL: self.component}, s.value,
                                       s.timestamp, s.exemplar) for s in family.samples]
            yield labelled

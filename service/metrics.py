"""Prometheus metrics of the engine process (prometheus-client, one registry per engine).

Gauges are read from the scheduler at scrape time (one consistent snapshot under the engine
lock), so they can never drift from the truth; histograms and counters are fed by the engine's
step listener and by the servicer (rejections). The process's own `process_*` series (memory,
CPU, file descriptors, start time) carry `component="engine"` (`genserve.common.process_metrics`).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.core.engine import Engine
from engine.core.outputs import FinishReason, TokenEvent
from engine.core.plan import StepPlan
from genserve.common.process_metrics import ComponentProcessCollector

PROMPT_BUCKETS = (256, 1024, 4096, 8192)            # prompt-length bucket upper bounds, tokens
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 1.5,
                     2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)


def prompt_bucket(num_prompt_tokens: int) -> str:
    """The label of the design's prompt-length bucket: "256", "1024", "4096" or "8192" (≤ bound)."""
    for bound in PROMPT_BUCKETS:
        if num_prompt_tokens <= bound:
            return str(bound)
    return "inf"


class _SchedulerGauges(Collector):
    """Collects the scheduler's gauges and monotonic counters at scrape time."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self):
        s = self.engine.stats()
        for name, doc, value in (
            ("genserve_queue_depth", "Requests waiting for admission.", s.queue_depth),
            ("genserve_queued_device_seconds", "Estimated device-seconds of queued work.", s.queued_device_s),
            ("genserve_running_rows", "Requests admitted to the running batch.", s.running_rows),
            ("genserve_kv_blocks_free", "KV blocks a request can be given (cached ones included).",
             s.kv_blocks_free),
            ("genserve_kv_blocks_capacity", "KV blocks in the pool (free + in use).", s.kv_blocks_total),
            ("genserve_kv_blocks_cached", "KV blocks kept for prefix reuse, held by no request.",
             s.kv_blocks_cached),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily("genserve_prefix_cache_queried_tokens",
                                  "Prompt tokens looked up in the prefix cache at admission.",
                                  value=s.prefix_queried_tokens)
        yield CounterMetricFamily("genserve_prefix_cache_hit_tokens",
                                  "Prompt tokens the prefix cache held (taken, not computed).",
                                  value=s.prefix_hit_tokens)
        yield CounterMetricFamily("genserve_preemptions", "Requests preempted (blocks freed, re-queued).",
                                  value=s.num_preemptions)
        yield CounterMetricFamily("genserve_cancelled_tokens",
                                  "Tokens computed for requests after they were cancelled.",
                                  value=s.num_cancelled_tokens)
        yield CounterMetricFamily("genserve_steps", "Forward passes run.", value=self.engine.num_steps)
        expert_load = getattr(self.engine.executor, "expert_load", None)
        layers = expert_load() if expert_load is not None else []
        if layers:
            family = CounterMetricFamily(
                "genserve_moe_expert_tokens",
                "Tokens routed to each expert of each mixture-of-experts layer (routing skew).",
                labels=["layer", "expert"])
            for layer, counts in layers:
                for expert, n in enumerate(counts):
                    family.add_metric([str(layer), str(expert)], n)
            yield family


class _LoraCounters(Collector):
    """LoRA adapters' loads and residency, read from the model runner at scrape time
    (`engine.runner.lora`: the registry's loads and unloads, the resident slots' loads and
    evictions); nothing for an executor without adapters (the simulator)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self):
        executor = self.engine.executor
        registry = getattr(executor, "adapters", None) or getattr(getattr(executor, "inner", None), "adapters", None)
        slots = getattr(executor, "loras", None) or getattr(getattr(executor, "inner", None), "loras", None)
        if registry is None or slots is None:
            return
        yield CounterMetricFamily("genserve_lora_loads", "LoRA adapters loaded (at start or POST /v1/load_lora_adapter).",
                                  value=registry.loads)
        yield CounterMetricFamily("genserve_lora_unloads", "LoRA adapters unloaded.", value=registry.unloads)
        yield GaugeMetricFamily("genserve_lora_adapters", "LoRA adapters served now.", value=len(registry.adapters()))
        yield CounterMetricFamily("genserve_lora_slot_loads",
                                  "LoRA adapters made resident where the products run (from host memory).",
                                  value=slots.loads)
        yield CounterMetricFamily("genserve_lora_evictions",
                                  "Resident LoRA adapters evicted (least recently used past --max-loras, or unloaded).",
                                  value=slots.evictions)
        yield GaugeMetricFamily("genserve_lora_resident", "LoRA adapters resident now.",
                                value=len(slots.resident_ids))


class EngineMetrics:
    """All metrics of one engine, in their own `CollectorRegistry`.

    Args:
        engine: the engine to observe; a step listener is attached to it.
        registry: where to register (a new one by default).
    """

    def __init__(self, engine: Engine, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.engine = engine
        labels = ["prompt_bucket"]
        self.ttft = Histogram("genserve_ttft_seconds", "Arrival to first token.", labels,
                              buckets=LATENCY_BUCKETS_S, registry=r)
        self.tpot = Histogram("genserve_tpot_seconds", "Mean time per output token after the first.",
                              labels, buckets=LATENCY_BUCKETS_S, registry=r)
        self.max_gap = Histogram("genserve_max_token_gap_seconds",
                                 "Longest gap between two tokens of a request.", labels,
                                 buckets=LATENCY_BUCKETS_S, registry=r)
        self.queue_wait = Histogram("genserve_queue_wait_seconds", "Arrival to admission.", labels,
                                    buckets=LATENCY_BUCKETS_S, registry=r)
        self.e2e = Histogram("genserve_e2e_seconds", "Arrival to finish.", labels,
                             buckets=LATENCY_BUCKETS_S, registry=r)
        self.rows = Histogram("genserve_step_rows", "Decode rows per step.", buckets=ROW_BUCKETS, registry=r)
        self.step_s = Histogram("genserve_step_duration_seconds", "Forward pass + sampling time.",
                                buckets=LATENCY_BUCKETS_S, registry=r)
        self.step_ratio = Histogram("genserve_step_time_ratio",
                                    "Measured step time / the cost model's prediction when the step was built.",
                                    buckets=(0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0), registry=r)
        self.cancel_steps = Histogram("genserve_cancel_extra_steps",
                                      "Steps a request ran after its cancel flag was set.",
                                      buckets=(0, 1, 2, 5), registry=r)
        self.finished = Counter("genserve_requests_finished", "Requests ended, by finish reason.",
                                ["finish_reason"], registry=r)
        self.rejected = Counter("genserve_requests_rejected", "Requests refused, by HTTP-equivalent code.",
                                ["code"], registry=r)
        self.prompt_tokens = Counter("genserve_prompt_tokens", "Prompt tokens of finished requests.",
                                     registry=r)
        self.generated_tokens = Counter("genserve_generated_tokens", "Tokens sampled.", registry=r)
        self.cancelled_generated = Counter(
            "genserve_cancelled_request_generated_tokens",
            "Tokens generated for requests that were later cancelled.", registry=r)
        self.lora_requests = Counter("genserve_lora_requests", "Requests run on each LoRA adapter.",
                                     ["adapter"], registry=r)
        self.lora_tokens = Counter("genserve_lora_tokens",
                                   "Tokens computed on each LoRA adapter: prompt (prefill) and generated (sampled).",
                                   ["adapter", "kind"], registry=r)
        self.buffer_overflows = Counter(
            "genserve_stream_buffer_overflows",
            "Requests cancelled because their client read too slowly (output buffer full).",
            registry=r)
        for reason in FinishReason:
            self.finished.labels(reason.value)
        for code in ("400", "401", "429", "503"):
            self.rejected.labels(code)
        backend = getattr(getattr(engine.executor, "attention", None), "name", None)
        if backend:     # the model executor's attention backend (engine/attention/__init__.py)
            Info("genserve_attention_backend", "Attention backend the engine runs.",
                 registry=r).info({"backend": backend})
        r.register(_SchedulerGauges(engine))
        r.register(_LoraCounters(engine))
        r.register(ComponentProcessCollector("engine"))
        engine.step_listeners.append(self.on_step)

    def on_step(self, plan: StepPlan, events: list[TokenEvent], step_s: float) -> None:
        """Step listener: step histograms, and per-request histograms on finish events."""
        if not plan.empty:
            self.step_s.observe(step_s)
            self.rows.observe(plan.num_decode_rows)
            if self.engine.last_step_predicted_s > 0:
                self.step_ratio.observe(step_s / self.engine.last_step_predicted_s)
            for seg in plan.segments:
                if seg.request.lora is not None and not seg.decode:
                    self.lora_tokens.labels(seg.request.lora.name, "prompt").inc(seg.length)
            for _, req in plan.draws:
                if req.lora is not None:
                    self.lora_tokens.labels(req.lora.name, "generated").inc()
        self.observe_events(events)

    def observe_events(self, events: list[TokenEvent]) -> None:
        """Count tokens and record the latencies of requests that finished."""
        for ev in events:
            if ev.token_id is not None:
                self.generated_tokens.inc()
            if ev.finish_reason is None:
                continue
            self.finished.labels(ev.finish_reason.value).inc()
            self.prompt_tokens.inc(ev.num_prompt_tokens)
            bucket = prompt_bucket(ev.num_prompt_tokens)
            if ev.ttft_ms is not None:
                self.ttft.labels(bucket).observe(ev.ttft_ms / 1000.0)
            if ev.tpot_ms is not None:
                self.tpot.labels(bucket).observe(ev.tpot_ms / 1000.0)
                self.max_gap.labels(bucket).observe(ev.max_gap_ms / 1000.0)
            if ev.queue_ms is not None:
                self.queue_wait.labels(bucket).observe(ev.queue_ms / 1000.0)
            if ev.e2e_ms is not None:
                self.e2e.labels(bucket).observe(ev.e2e_ms / 1000.0)
            if ev.finish_reason == FinishReason.CANCELLED:
                self.cancel_steps.observe(ev.steps_after_cancel)
                self.cancelled_generated.inc(ev.num_completion_tokens)

"""The server's Prometheus metrics (``GET /metrics``, text format through ``prometheus_client``),
in a registry of their own per engine, so that two servers in one process do not clash. The engine
records what it sees (queue depth, the running batch's rows, generated tokens, per-token timing, all
on the host: the tokens are already read there); the routes record each request's outcome."""
from __future__ import annotations

import threading
from collections import deque

import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

OUTCOMES = {200: "ok", 400: "bad_request", 413: "too_large", 415: "unsupported_media_type", 499: "cancelled",
            500: "error", 503: "busy", 504: "timeout"}
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    def __init__(self, max_batch: int, queued=lambda: 0):
        """``queued``: a function giving the rows waiting now (read when /metrics is asked)."""
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.max_batch = max_batch
        self.requests = Counter("gptrain_requests", "Requests answered, by endpoint and outcome",
                                ["endpoint", "outcome"], registry=r)
        self.queue_depth = Gauge("gptrain_queue_depth", "Rows (prompts x n) waiting for a batch", registry=r)
        self.queue_depth.set_function(lambda: float(queued()))
        self.batch_occupancy = Gauge("gptrain_batch_occupancy",
                                     "Rows of the running batch / --max-batch (0 when idle)", registry=r)
        self.generated_tokens = Counter("gptrain_generated_tokens", "Tokens generated (all rows)", registry=r)
        self.ttft = BatchedHistogram("gptrain_time_to_first_token_seconds",
                                     "From a request's arrival in the queue to its row's first generated token",
                                     TTFT_BUCKETS, r)
        self.itl = BatchedHistogram("gptrain_inter_token_latency_seconds", "Between two generated tokens of one row",
                                    ITL_BUCKETS, r)
        # where a server's time goes under load (in-flight batching): steps and the rows they ran, the
        # prompts that joined, and the host's time blocked on the device (close to the elapsed time: the
        # device is the limit; far below it: the host is)
        self.decode_steps = Counter("gptrain_decode_steps", "Decode steps issued to the device", registry=r)
        self.decode_rows = Counter("gptrain_decode_rows", "Rows decoding, summed over the decode steps",
                                   registry=r)
        self.prompt_joins = Counter("gptrain_prompt_joins", "Prompts that joined the running batch", registry=r)
        self.loop = LoopClock(r)  # also gptrain_device_wait_seconds: its "wait" phase

    def outcome(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, outcome=OUTCOMES.get(status, str(status))).inc()

    def batch(self, rows: int) -> None:
        self.batch_occupancy.set(rows / self.max_batch)

    def text(self) -> tuple[bytes, str]:
        """The exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class BatchedHistogram:
    """A Prometheus histogram whose ``observe`` only appends to a list: the decode loop observes every
    row's every token, and prometheus_client's ``Histogram.observe`` (a lock and a bucket search each)
    costs the loop more than the rest of a row's work. The values are counted into the buckets with
    numpy when ``/metrics`` is read (or when many are pending)."""

    FOLD_AT = 1 << 16

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...], registry):
        self.name, self.documentation = name, documentation
        self.edges = np.asarray(buckets, dtype=np.float64)
        self.counts = np.zeros(len(buckets) + 1, dtype=np.int64)  # the last: above every edge (+Inf)
        self.total = 0.0
        self._pending: deque[float] = deque()  # appended by the loop, drained by whoever folds (both atomic)
        self._lock = threading.Lock()
        registry.register(self)

    def observe(self, value: float) -> None:
        self._pending.append(value)
        if len(self._pending) >= self.FOLD_AT:
            self._fold()

    def _fold(self) -> None:
        with self._lock:
            pending = self._pending
            values = np.fromiter((pending.popleft() for _ in range(len(pending))), dtype=np.float64)
            if values.size:
                # Prometheus buckets are "less than or equal": a value on an edge counts in that bucket
                self.counts += np.bincount(np.searchsorted(self.edges, values, side="left"),
                                           minlength=len(self.counts))
                self.total += float(values.sum())

    def collect(self):
        self._fold()
        cumulative = np.cumsum(self.counts)
        buckets = [(repr(float(edge)), int(n)) for edge, n in zip(self.edges, cumulative[:-1])]
        buckets.append(("+Inf", int(cumulative[-1])))
        family = HistogramMetricFamily(self.name, self.documentation, buckets=buckets, sum_value=self.total)
        yield family

    def describe(self):
        return [HistogramMetricFamily(self.name, self.documentation)]


class LoopClock:
    """Where the in-flight decode loop's wall time goes, by phase (``gptrain_loop_seconds``): ``idle``
    (nothing running: waiting for a request), ``take`` (the queue, ended and expired jobs), ``admit``
    (prompts into slots), ``issue`` (steps queued to the device), ``wait`` (blocked on a step's ids: the
    device is behind; also exposed alone as ``gptrain_device_wait_seconds``), ``tokens`` (each row's new
    token: stop rules, streams, answers). Plain floats on the loop's thread, read at ``/metrics``."""

    PHASES = ("idle", "take", "admit", "issue", "wait", "tokens")

    def __init__(self, registry):
        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        registry.register(self)

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds

    @staticmethod
    def _families() -> tuple[CounterMetricFamily, CounterMetricFamily]:
        return (CounterMetricFamily("gptrain_loop_seconds", "The in-flight decode loop's wall time by phase",
                                    labels=["phase"]),
                CounterMetricFamily("gptrain_device_wait_seconds", "Host time spent waiting for a decode step's ids"))

    def collect(self):
        phases, wait = self._families()
        seconds = dict(self.seconds)
        for phase, value in seconds.items():
            phases.add_metric([phase], value)
        wait.add_metric([], seconds["wait"])
        yield phases
        yield wait

    def describe(self):
        return list(self._families())

"""The server's Prometheus metrics (``GET /metrics``, text format through ``prometheus_client``),
in a registry of their own per engine, so that two servers in one process do not clash. The engine
records what it sees (queue depth, the running batch's rows, generated tokens, per-token timing, all
on the host: the tokens are already read there); the routes record each request's outcome."""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

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
        self.ttft = Histogram("gptrain_time_to_first_token_seconds",
                              "From a request's arrival in the queue to its row's first generated token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("gptrain_inter_token_latency_seconds", "Between two generated tokens of one row",
                             buckets=ITL_BUCKETS, registry=r)
        # where a server's time goes under load (in-flight batching): steps and the rows they ran, the
        # prompts that joined, and the host's time blocked on the device (close to the elapsed time: the
        # device is the limit; far below it: the host is)
        self.decode_steps = Counter("gptrain_decode_steps", "Decode steps issued to the device", registry=r)
        self.decode_rows = Counter("gptrain_decode_rows", "Rows decoding, summed over the decode steps",
                                   registry=r)
        self.prompt_joins = Counter("gptrain_prompt_joins", "Prompts that joined the running batch", registry=r)
        self.device_wait = Counter("gptrain_device_wait_seconds",
                                   "Host time spent waiting for a decode step's ids", registry=r)

    def outcome(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, outcome=OUTCOMES.get(status, str(status))).inc()

    def batch(self, rows: int) -> None:
        self.batch_occupancy.set(rows / self.max_batch)

    def text(self) -> tuple[bytes, str]:
        """The exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

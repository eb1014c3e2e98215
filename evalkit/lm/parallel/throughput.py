"""A run's throughput over its replicas: the run's own clock and output rate, the replicas' rates added up (they run
side by side), and each replica's own measurement under the subset ``replica<i>``."""

from __future__ import annotations

import time

from evalkit.memory.measure import Throughput


class ReplicaThroughput(Throughput):
    """What :class:`~evalkit.memory.measure.Throughput` records for one engine, for a :class:`~evalkit.lm.parallel.pool.ReplicaPool`."""

    def __init__(self):
        super().__init__()
        self.replicas: list[Throughput] = []

    def stop(self, engine, model=None) -> None:
        if self._started is not None:
            self.wall_seconds += time.perf_counter() - self._started
            self._started = None
        if engine is not None:
            self.replicas = engine.throughputs()

    def output_rate(self) -> float | None:
        elapsed = self._elapsed()
        return self.generated_tokens / elapsed if elapsed > 0 and self.generated_tokens else None

    def describe(self) -> str:
        rate = self.output_rate()
        return f"{rate:,.1f} tok/s out" if rate else "waiting for the replicas' first requests"

    def rows(self) -> list[dict]:
        if not self.requests:
            return []
        steps = sum(r.decode_steps for r in self.replicas)
        rates = {"prefill_tokens_per_s": [r.prefill_rate() for r in self.replicas],
                 "decode_tokens_per_s": [r.decode_rate() for r in self.replicas]}
        values = {"wall_seconds": self.wall_seconds, "output_tokens_per_s": self.output_rate(),
                  "replicas": float(len(self.replicas)),
                  **{name: sum(v for v in found if v) or None for name, found in rates.items()},
                  "slot_utilization": (sum(r.utilization * r.decode_steps for r in self.replicas if r.utilization)
                                       / steps if steps else None),
                  "kv_cache_allocated_bytes": sum(r.cache_bytes or 0 for r in self.replicas) or None}
        peaks = [r.peak_memory for r in self.replicas if r.peak_memory[1]]
        if peaks:  # the largest replica's (each holds its own model and cache)
            values[peaks[0][0]] = max(peak for _, peak in peaks)
        rows = [{"subset": "all", "metric": name, "value": float(value), "stderr": None, "n": self.requests}
                for name, value in values.items() if value is not None]
        for index, replica in enumerate(self.replicas):
            rows += [{**row, "subset": f"replica{index}"} for row in replica.rows()]
        return rows

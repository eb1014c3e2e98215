"""What a run measures of its own cost, on the host around what already synchronises: prefill and decode throughput,
the engine's cache allocation and steps, peak memory, and the decode step against its roofline and the simulator.

Nothing here adds a sync inside the compiled decode step: times are taken where the engine already syncs (a request's
prefill, its completion), and the bandwidth a step is held to is measured after the generation.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch


def _peak_rss() -> int:
    """This process's peak resident set since the last reset (Linux VmHWM; elsewhere getrusage's lifetime peak)."""
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


class Throughput:
    """Prefill and decode throughput measured on the host around what already synchronises (the engine's prefill
    timing and the completion of a request), so that measuring adds no sync inside the compiled decode step.

    Prefill: prompt tokens over the prefill seconds the engine measured per request. Decode: tokens generated after
    each request's first (the prefill's) over the rest of the generation wall time."""

    def __init__(self):
        self.prompt_tokens = self.generated_tokens = self.requests = 0
        self.prefill_seconds = self.wall_seconds = 0.0
        self.utilization: float | None = None
        self.cache_bytes: int | None = None  # the engine's KV cache allocation, all slots
        self.peak_memory: tuple[str, int] = ("peak_rss_bytes", 0)  # CUDA: max allocated; CPU: peak resident set
        self.decode_steps = 0
        self.step_bytes: int | None = None  # bytes one decode step reads at least: parameters + the static cache
        self.device: torch.device | None = None
        self._started: float | None = None

    def start(self, device: torch.device | None = None) -> None:
        """Start timing; reset the peak-memory counter of ``device`` (CUDA) or of this process (CPU)."""
        self._started = time.perf_counter()
        self.device = device
        if device is not None and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        else:  # Linux: reset the process's peak resident set (VmHWM) to what it holds now
            try:
                with open("/proc/self/clear_refs", "w") as handle:
                    handle.write("5")
            except OSError:
                pass

    def add(self, stats: dict) -> None:
        self.requests += 1
        self.prompt_tokens += int(stats.get("prompt_tokens") or 0)
        self.generated_tokens += int(stats.get("generated_tokens") or 0)
        self.prefill_seconds += float(stats.get("prefill_seconds") or 0.0)

    def stop(self, engine, model=None) -> None:
        """Stop timing; read what the engine counted (its steps, utilization and cache) and what a decode step reads
        at least (every parameter once and the whole static cache: attention reads every reserved slot)."""
        if self._started is not None:
            self.wall_seconds += time.perf_counter() - self._started
            self._started = None
        if engine is not None and engine.counters["decode_steps"]:
            self.utilization = engine.utilization()
        if engine is not None and engine.cache is not None:  # its slots' tensors (packed, reduced or dense)
            self.cache_bytes = engine.cache.nbytes()
        if engine is not None:
            self.decode_steps = engine.counters["decode_steps"]
        if model is not None and self.cache_bytes is not None:
            self.step_bytes = weight_bytes_read(model) + self.cache_bytes
        if self.device is not None and self.device.type == "cuda":
            self.peak_memory = ("peak_cuda_memory_bytes",
                                max(self.peak_memory[1], torch.cuda.max_memory_allocated(self.device)))
        else:
            self.peak_memory = ("peak_rss_bytes", max(self.peak_memory[1], _peak_rss()))

    def _elapsed(self) -> float:
        return self.wall_seconds + (time.perf_counter() - self._started if self._started is not None else 0.0)

    def prefill_rate(self) -> float | None:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else None

    def _decode_seconds(self) -> float:
        """Generation time not spent in prefill."""
        return self._elapsed() - self.prefill_seconds

    def decode_rate(self) -> float | None:
        decode_seconds = self._decode_seconds()
        decoded = self.generated_tokens - self.requests  # each request's first token comes from its prefill
        return decoded / decode_seconds if decode_seconds > 0 and decoded > 0 else None

    def rows(self) -> list[dict]:
        """Metrics rows of what this process measured (none when every generation was resumed)."""
        if not self.requests:
            return []
        values = {"wall_seconds": self.wall_seconds, "prefill_tokens_per_s": self.prefill_rate(),
                  "decode_tokens_per_s": self.decode_rate(), "slot_utilization": self.utilization,
                  "kv_cache_allocated_bytes": self.cache_bytes, self.peak_memory[0]: self.peak_memory[1] or None}
        return [{"subset": "all", "metric": name, "value": float(value), "stderr": None, "n": self.requests}
                for name, value in {**values, **self._step_values()}.items() if value is not None]

    def _step_values(self) -> dict:
        """The measured decode step beside two predictions of it: the roofline (its bytes over the copy bandwidth
        measured here, now) and, on a GPU that conf/hardware describes, the simulator's own (datasheet bandwidth x
        its ``decode_efficiency``), each with measured / predicted."""
        decode_seconds = self._decode_seconds()
        if not self.decode_steps or decode_seconds <= 0 or self.step_bytes is None:
            return {}
        step = decode_seconds / self.decode_steps
        bandwidth = copy_bandwidth(self.device or torch.device("cpu"))
        roofline = self.step_bytes / bandwidth
        values = {"decode_step_seconds": step, "decode_step_bytes": self.step_bytes,
                  "copy_bandwidth_bytes_per_s": bandwidth, "decode_step_seconds_roofline": roofline,
                  "decode_efficiency": roofline / step}
        hardware = hardware_of(self.device)
        if hardware is not None:
            predicted = self.step_bytes / (hardware.hbm_bandwidth * hardware.decode_efficiency)
            values |= {"decode_step_seconds_predicted": predicted, "decode_step_measured_over_predicted": step / predicted}
        return values


_BANDWIDTHS: dict[str, float] = {}  # measured once per device and process: a sweep's later runs reuse it


def copy_bandwidth(device: torch.device | str, megabytes: int | None = None, repeats: int = 10,
                   fresh: bool = False) -> float:
    """Bytes read plus written per second by a large device-to-device copy (the median of ``repeats`` after two
    warm-ups; 1 GiB on a GPU, 256 MiB elsewhere): the bandwidth a memory-bound decode step can hope for on this
    machine, measured rather than assumed. The default measurement is made once per device in a process (``fresh``:
    measure again)."""
    device = torch.device(device)
    if megabytes is None and repeats == 10 and not fresh:
        if str(device) not in _BANDWIDTHS:
            _BANDWIDTHS[str(device)] = copy_bandwidth(device, fresh=True)
        return _BANDWIDTHS[str(device)]
    size = (megabytes or (1024 if device.type == "cuda" else 256)) << 20
    source = torch.empty(size, dtype=torch.uint8, device=device).random_(0, 255)
    target = torch.empty_like(source)
    times = []
    for _ in range(repeats + 2):
        _sync(device)
        start = time.perf_counter()
        target.copy_(source)
        _sync(device)
        times.append(time.perf_counter() - start)
    return 2 * size / statistics.median(times[2:])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def weight_bytes_read(model) -> int:
    """Bytes of the weights one decode step reads: all of them once, except the input embedding (a few rows; a tied
    output projection reads it whole)."""
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total -= embed.numel() * embed.element_size()
    if head is embed:
        total += head.numel() * head.element_size()
    return total


GPU_HARDWARE = {"H100": "h100_80g", "H200": "h200_141g"}  # a CUDA device name's word -> conf/hardware


def hardware_of(device: torch.device | None):
    """The conf/hardware entry that describes ``device`` (a GPU whose name it knows), else None."""
    if device is None or device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    known = next((conf for word, conf in GPU_HARDWARE.items() if word in name), None)
    if known is None:
        return None
    from evalkit.memory import load_hardware

    return load_hardware(known)

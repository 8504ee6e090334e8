"""Per-epoch training telemetry in plain torch: throughput, step time, data wait, peak memory, MFU, a profiler window.

    timer = StepTimer(device, precision="bf16", flops_per_sample=6 * n_params * block_size)
    for inputs, targets in timer.steps(loader):   # times the wait for each batch and the step around it
        ...
    metrics = {"train_loss": ..., **timer.end_epoch()}   # perf/samples_per_s, perf/mfu_pct, ...

It imports torch only, never Ray or MLflow: benchmarks/gpu_throughput.py runs the same code on a GPU
machine that has nothing else. gpuflow.cluster.loop.telemetry builds one for a Ray Train worker.
"""

from __future__ import annotations

import re
import resource
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

# Dense peak TFLOPS per GPU from the vendors' datasheets: (bf16/fp16 tensor cores, tf32 tensor cores, plain fp32).
# Keys are the words of torch.cuda.get_device_name(), so 'A10' never matches an 'A100' or an 'A10G'.
PEAK_TFLOPS: dict[tuple[str, ...], tuple[float, float, float]] = {
    ("H100", "PCIE"): (756, 378, 51),
    ("H100", "NVL"): (835, 418, 60),
    ("H100",): (989, 494, 67),  # SXM: "NVIDIA H100 80GB HBM3"
    ("GH200",): (989, 494, 67),
    ("H200",): (989, 494, 67),
    ("A100",): (312, 156, 19.5),
    ("L40S",): (362, 183, 91.6),
    ("L4",): (121, 60, 30.3),
    ("A10",): (125, 62.5, 31.2),
    ("V100",): (125, 15.7, 15.7),  # fp16 tensor cores; no bf16 or tf32 units
    ("T4",): (65, 8.1, 8.1),
}


def accelerator_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def peak_tflops(device_name: str, precision: str, tf32: bool = False) -> float | None:
    """The device's dense peak for the precision the matmuls run in; None for a device not in PEAK_TFLOPS."""
    words = set(re.split(r"[^A-Z0-9]+", device_name.upper()))
    for key, (half, tf32_peak, fp32) in PEAK_TFLOPS.items():
        if words.issuperset(key):
            if precision in ("bf16", "fp16"):
                return half
            return tf32_peak if tf32 else fp32
    return None


def model_flops_per_sample(model: torch.nn.Module, tokens_per_sample: int = 1) -> float:
    """6·N FLOPs per token (forward 2·N, backward 4·N) for a dense model of N parameters; attention is extra."""
    module = getattr(model, "module", model)  # DistributedDataParallel wraps the model
    return 6.0 * sum(p.numel() for p in module.parameters()) * tokens_per_sample


def count_samples(batch) -> int:
    """Examples in a batch: the first dimension of its first tensor (a tensor, a tuple/list, or a dict of them)."""
    if isinstance(batch, dict):
        batch = next(iter(batch.values()))
    if isinstance(batch, (tuple, list)):
        batch = batch[0]
    return int(batch.shape[0]) if hasattr(batch, "shape") else len(batch)


def peak_memory_mb(device: torch.device) -> float:
    """The accelerator's peak allocated memory; on CPU the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # ru_maxrss is in KiB on Linux and in bytes on macOS
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 2**10)


def synchronize(device: torch.device) -> None:
    # CUDA kernels run asynchronously: without this, an epoch "ends" while its last steps are still queued.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ProfileWindow:
    """torch.profiler over `steps` training steps after skipping `after`; writes trace.json and top_operators.txt.

    `on_ready(folder)` receives the folder once the window closes (or the run ends inside it), e.g. to log
    it to MLflow. The trace is Chrome trace JSON: it opens in https://ui.perfetto.dev and chrome://tracing.
    """

    def __init__(
        self,
        device: torch.device,
        steps: int,
        after: int = 0,
        on_ready: Callable[[Path], None] | None = None,
        folder: str | Path | None = None,
    ):
        self.device, self.steps, self.after = device, steps, after
        self.on_ready = on_ready
        self.folder = Path(folder) if folder else Path(tempfile.mkdtemp(prefix="gpuflow-profile-"))
        self.recorded_steps = 0
        self.done = False
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(
            activities=activities,
            # one warm-up step before recording: the profiler's own start-up would otherwise sit in the first
            schedule=torch.profiler.schedule(wait=max(after - 1, 0), warmup=min(after, 1), active=steps, repeat=1),
            on_trace_ready=self._write,
        )
        self.profiler.start()
        self.steps_seen = 0

    def step(self) -> None:
        """Marks the end of one training step."""
        if self.done:
            return
        self.steps_seen += 1
        self.profiler.step()
        if self.done:  # the schedule's window just closed and _write ran
            self.profiler.stop()

    def close(self) -> None:
        """Ends the window early (the run had fewer steps): writes what was recorded, if anything."""
        if not self.done:
            self.profiler.stop()
            self.done = True

    def _write(self, profiler: torch.profiler.profile) -> None:
        self.done = True
        self.recorded_steps = max(0, min(self.steps, self.steps_seen - self.after))
        self.folder.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(self.folder / "trace.json"))
        sort_by = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = profiler.key_averages().table(sort_by=sort_by, row_limit=25)
        header = (
            f"torch.profiler: {self.recorded_steps} step(s) recorded after skipping {self.after}, "
            f"on {accelerator_name(self.device)}; top operators by {sort_by}\n\n"
        )
        (self.folder / "top_operators.txt").write_text(header + table)
        if self.on_ready:
            self.on_ready(self.folder)


class StepTimer:
    """Times a training loop's steps and data waits; end_epoch() returns the epoch's figures as metrics.

    Figures (MLflow metric names): perf/samples_per_s (the whole job: this worker's rate × world_size, as
    DDP ranks step together), perf/tokens_per_s (when tokens_per_sample is given), perf/step_time_ms,
    perf/data_wait_pct (share of the epoch's training time spent waiting for the next batch),
    perf/peak_memory_mb (torch.cuda.max_memory_allocated on GPU, peak RSS on CPU) and perf/mfu_pct
    (model FLOPs per second over the device's peak, when both are known; `mfu_note` says why not).
    """

    def __init__(
        self,
        device: torch.device | str = "cpu",
        precision: str = "fp32",
        flops_per_sample: float | None = None,
        tokens_per_sample: int | None = None,
        world_size: int = 1,
        samples_of: Callable = count_samples,
        profile: ProfileWindow | None = None,
    ):
        self.device = torch.device(device)
        self.tokens_per_sample = tokens_per_sample
        self.flops_per_sample = flops_per_sample
        self.world_size = world_size
        self.samples_of = samples_of
        self.profile = profile
        name = accelerator_name(self.device)
        tf32 = self.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32
        self.peak_flops = (peak_tflops(name, precision, tf32) or 0) * 1e12 or None
        if flops_per_sample is None:
            self.mfu_note = "no MFU: the loop states no FLOPs per sample (flops_per_sample or model)"
        elif self.peak_flops is None:
            self.mfu_note = f"no MFU: the peak FLOPs of {name!r} are unknown (known: {known_accelerators()})"
        else:
            self.mfu_note = f"MFU against {name}'s {self.peak_flops / 1e12:g} TFLOPS ({precision})"
        self._reset()

    def _reset(self) -> None:
        self.started = self.ended = None
        self.steps_done = self.samples = 0
        self.data_wait_s = 0.0

    def steps(self, batches: Iterable) -> Iterator:
        """Yields the batches, timing how long each took to arrive and the step that used it."""
        iterator = iter(batches)
        try:
            while True:
                requested = time.perf_counter()
                if self.started is None:
                    self.started = requested
                    if self.device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(self.device)
                try:
                    batch = next(iterator)
                except StopIteration:
                    return
                self.data_wait_s += time.perf_counter() - requested
                self.samples += self.samples_of(batch)
                yield batch
                # the loop's body for this batch is done: one step
                self.steps_done += 1
                if self.profile:
                    self.profile.step()
        finally:
            synchronize(self.device)
            self.ended = time.perf_counter()

    def end_epoch(self) -> dict[str, float]:
        """The figures of the steps since the last call, then starts counting afresh; {} if no step ran."""
        if not self.steps_done or self.started is None:
            self._reset()
            return {}
        elapsed = max((self.ended or time.perf_counter()) - self.started, 1e-9)
        rate = self.samples / elapsed  # this worker's
        figures = {
            "perf/samples_per_s": rate * self.world_size,
            "perf/step_time_ms": 1000 * elapsed / self.steps_done,
            "perf/data_wait_pct": 100 * self.data_wait_s / elapsed,
            "perf/peak_memory_mb": peak_memory_mb(self.device),
        }
        if self.tokens_per_sample:
            figures["perf/tokens_per_s"] = rate * self.world_size * self.tokens_per_sample
        if self.flops_per_sample and self.peak_flops:
            figures["perf/mfu_pct"] = 100 * self.flops_per_sample * rate / self.peak_flops
        self._reset()
        return figures

    def close(self) -> None:
        """Ends a profile window still open (a run shorter than after + steps)."""
        if self.profile:
            self.profile.close()


def known_accelerators() -> str:
    return ", ".join(" ".join(key) for key in PEAK_TFLOPS)

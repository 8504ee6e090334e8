"""Training throughput of gpuflow's loop against a bare torch loop: same model, same batches, fp32 against bf16, MFU.

    python benchmarks/gpu_throughput.py                  # on a GPU: the model and batch of experiments/chargpt-gpu.yaml
    python benchmarks/gpu_throughput.py --compile        # the same under torch.compile
    python benchmarks/gpu_throughput.py --tiny           # a CPU-sized model, for CI

"gpuflow" is experiments.chargpt.train_epoch with gpuflow.cluster.telemetry's StepTimer (what each Ray Train worker
runs, at world size 1); "bare" is the textbook loop written out below. Both run in plain torch: no Ray, Prefect or
MLflow is imported, so it runs on a machine that has only torch. The two alternate, and each figure is the best of
--repeats, so that a slow moment of a shared machine does not decide the ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.chargpt import (  # noqa: E402
    GPT,
    GPTConfig,
    autocast,
    batches,
    encode,
    make_optimizer,
    make_text,
    train_epoch,
    windows,
)
from gpuflow.cluster.telemetry import StepTimer, accelerator_name, peak_tflops  # noqa: E402

# experiments/chargpt-gpu.yaml's model and batch (a test keeps the two equal)
GPU_SHAPE = {"block_size": 1024, "n_layer": 12, "n_head": 12, "n_embd": 768, "batch_size": 16}
TINY_SHAPE = {"block_size": 32, "n_layer": 1, "n_head": 2, "n_embd": 32, "batch_size": 8}


def bare_epoch(model, optimizer, loader, device, precision) -> None:
    """The loop anyone would write: copy, forward under autocast, backward, step."""
    model.train()
    for inputs, targets in loader:
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with autocast(precision, device):
            loss = model(inputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def timed(run, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def measure(
    precision: str, shape: dict, steps: int, warmup: int, repeats: int, device: torch.device, compile_model: bool
) -> dict:
    """samples/s of both loops (best of repeats), and the MFU of each."""
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    torch.backends.cudnn.allow_tf32 = precision == "tf32"
    amp = "fp32" if precision == "tf32" else precision  # tf32 is fp32 code with TF32 matmuls
    torch.manual_seed(0)
    config = GPTConfig(**{key: shape[key] for key in ("block_size", "n_layer", "n_head", "n_embd")})
    model = GPT(config).to(device)
    flops_per_sample = model.flops_per_token() * config.block_size
    optimizer = make_optimizer(model, 3e-4, device)
    runnable = torch.compile(model) if compile_model else model
    text = make_text(max(2_000, (steps + 2) * shape["batch_size"] * config.block_size // 25))
    dataset = windows(encode(text), config.block_size)
    subset = torch.utils.data.Subset(dataset, range(steps * shape["batch_size"]))
    loader = batches(subset, shape["batch_size"], device)
    warm = batches(torch.utils.data.Subset(dataset, range(warmup * shape["batch_size"])), shape["batch_size"], device)

    # warm-up: kernels chosen, allocator grown, torch.compile done, for both loops
    bare_epoch(runnable, optimizer, warm, device, amp)
    train_epoch(runnable, optimizer, warm, device, amp, StepTimer(device, amp))
    best = {"bare": float("inf"), "gpuflow": float("inf")}
    telemetry = {}
    for _ in range(repeats):
        best["bare"] = min(best["bare"], timed(lambda: bare_epoch(runnable, optimizer, loader, device, amp), device))
        timer = StepTimer(device, amp, flops_per_sample=flops_per_sample, tokens_per_sample=config.block_size)
        elapsed = timed(lambda timer=timer: train_epoch(runnable, optimizer, loader, device, amp, timer), device)
        if elapsed < best["gpuflow"]:
            best["gpuflow"], telemetry = elapsed, timer.end_epoch()
    samples = steps * shape["batch_size"]
    peak = peak_tflops(accelerator_name(device), amp, tf32=precision == "tf32")
    row = {"precision": precision, "params_m": sum(p.numel() for p in model.parameters()) / 1e6}
    for loop, seconds in best.items():
        row[f"{loop}_samples_per_s"] = samples / seconds
        row[f"{loop}_mfu_pct"] = 100 * flops_per_sample * samples / seconds / (peak * 1e12) if peak else None
    row["gpuflow_vs_bare"] = row["gpuflow_samples_per_s"] / row["bare_samples_per_s"]
    row["telemetry"] = telemetry  # what the loop itself logged for its best epoch
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a CPU-sized model and few steps (CI)")
    parser.add_argument("--steps", type=int, help="timed steps per measurement (default 30; 5 with --tiny)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5; 2 with --tiny)")
    parser.add_argument(
        "--repeats", type=int, default=None, help="measurements of each loop (default 3; 2 with --tiny)"
    )
    parser.add_argument(
        "--precisions", default=None, help="comma-separated: fp32,tf32,bf16 (default: fp32,bf16, plus tf32 on CUDA)"
    )
    parser.add_argument("--batch-size", type=int, help="sequences per step (default: the spec's 16; 8 with --tiny)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (both loops)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    shape = {**(TINY_SHAPE if args.tiny else GPU_SHAPE)}
    if args.batch_size:
        shape["batch_size"] = args.batch_size
    steps = args.steps or (5 if args.tiny else 30)
    warmup = args.warmup if args.warmup is not None else (2 if args.tiny else 5)
    repeats = args.repeats or (2 if args.tiny else 3)
    precisions = (args.precisions or ("fp32,tf32,bf16" if device.type == "cuda" else "fp32,bf16")).split(",")

    print(
        f"device {accelerator_name(device)}, torch {torch.__version__}, model {shape}, {steps} steps × {repeats}, "
        f"compile={args.compile}",
        flush=True,
    )
    rows = [measure(p, shape, steps, warmup, repeats, device, args.compile) for p in precisions]
    print(
        f"{'precision':>9} {'bare samples/s':>15} {'gpuflow samples/s':>18} {'gpuflow/bare':>13} {'MFU bare':>9} "
        f"{'MFU gpuflow':>12}"
    )
    for row in rows:
        mfu = [f"{row[k]:.1f}%" if row[k] is not None else "n/a" for k in ("bare_mfu_pct", "gpuflow_mfu_pct")]
        print(
            f"{row['precision']:>9} {row['bare_samples_per_s']:>15.1f} {row['gpuflow_samples_per_s']:>18.1f} "
            f"{row['gpuflow_vs_bare']:>12.1%} {mfu[0]:>9} {mfu[1]:>12}"
        )
    by_precision = {row["precision"]: row for row in rows}
    if "bf16" in by_precision:
        for base in ("fp32", "tf32"):
            if base in by_precision:
                speedup = by_precision["bf16"]["gpuflow_samples_per_s"] / by_precision[base]["gpuflow_samples_per_s"]
                print(f"bf16 / {base} (gpuflow loop): {speedup:.2f}x")
    if all(row["gpuflow_mfu_pct"] is None for row in rows):
        print(f"MFU: n/a, the peak FLOPs of {accelerator_name(device)!r} are not in cluster/telemetry.py's table")
    for row in rows:
        print(
            f"telemetry logged by the loop ({row['precision']}): "
            + ", ".join(f"{k}={v:.4g}" for k, v in row["telemetry"].items())
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "device": accelerator_name(device),
                    "compile": args.compile,
                    "shape": shape,
                    "steps": steps,
                    "rows": rows,
                },
                indent=2,
            )
        )
    if not args.tiny:  # --tiny is the tests' run: it writes nothing in the repository
        from benchmarks.record import record

        for row in rows:
            wait = row["telemetry"].get("perf/data_wait_pct")
            record(
                "gpu_throughput",
                {
                    "precision": row["precision"],
                    "compile": "yes" if args.compile else "no",
                    "batch": f"{shape['batch_size']} × {shape['block_size']}",
                    "steps": steps,
                    "repeats": repeats,
                    "bare samples/s": f"{row['bare_samples_per_s']:.1f}",
                    "gpuflow samples/s": f"{row['gpuflow_samples_per_s']:.1f}",
                    "gpuflow / bare %": f"{100 * row['gpuflow_vs_bare']:.1f}",
                    "MFU %": f"{row['gpuflow_mfu_pct']:.1f}" if row["gpuflow_mfu_pct"] is not None else None,
                    "data wait %": f"{wait:.1f}" if wait is not None else None,
                    "torch": f"{torch.__version__} (CUDA {torch.version.cuda})"
                    if torch.version.cuda
                    else torch.__version__,
                },
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

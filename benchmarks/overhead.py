"""gpuflow's fixed overhead: `gpuflow run` of the shipped digits spec against a bare Ray Train script, alternating.

    python benchmarks/overhead.py [--repeats 3]

Prints medians of wall time, cluster up, first training step, last step → last Ray process gone,
the overhead in seconds (gpuflow − bare) and the ratio. Both runs train the same loop on the same data.
"""

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "experiments" / "digits.yaml"
EPOCH = re.compile(r"\[gpuflow\] epoch \d+:")


def ray_processes(home: Path, exclude: int) -> list[int]:
    """Live Ray processes (daemons, workers, drivers, the job) started for this gpuflow home."""
    marker = f"GPUFLOW_HOME={home}\0".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == exclude:
            continue
        try:
            if marker not in (entry / "environ").read_bytes():
                continue
            command = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and (b"ray" in command or b"gpuflow.cluster.job" in command):
            found.append(int(entry.name))
    return found


def measure(command: list[str], env: dict, home: Path, driver_is_ray: bool) -> dict:
    """Runs one command, timestamping its output lines; watches its Ray processes until the last is gone."""
    started = time.time()
    marks: dict[str, float] = {}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    exclude = -1 if driver_is_ray else process.pid
    gone_at = [None]
    training_over = threading.Event()

    def watch():
        training_over.wait()
        while ray_processes(home, exclude):
            time.sleep(0.02)
        gone_at[0] = time.time()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    output = []
    for line in process.stdout:
        now = time.time()
        output.append(line)
        if "[bench] cluster up" in line or "local Ray cluster" in line:
            marks.setdefault("cluster_up", now - started)
        if EPOCH.search(line):
            marks.setdefault("first_step", now - started)
            marks["last_step_at"] = now
        if "[gpuflow] result" in line or "val_accuracy " in line:
            training_over.set()
    process.wait()
    ended = time.time()
    training_over.set()
    watcher.join(timeout=60)
    if process.returncode != 0:
        sys.exit("".join(output[-40:]) + f"\nbenchmark run failed: {command}")
    return {
        "wall": ended - started,
        "cluster_up": marks.get("cluster_up", float("nan")),
        "first_step": marks.get("first_step", float("nan")),
        "last_step_to_ray_gone": (gone_at[0] or ended) - marks.get("last_step_at", ended),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="gpuflow-bench-"))
    env = {**os.environ, "GPUFLOW_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    python = sys.executable
    gpuflow = [python, "-m", "gpuflow.flows.cli", "run", str(SPEC), "--set", f"data.train={home}/data/train.parquet",
               "--set", f"data.validation={home}/data/validation.parquet"]
    bare = [python, str(REPO / "benchmarks" / "bare_ray_train.py"), str(SPEC),
            f"data.train={home}/data/train.parquet", f"data.validation={home}/data/validation.parquet"]
    measure(gpuflow, env, home, False)  # warm-up: writes the data, creates the MLflow store and Prefect's database
    results = {"gpuflow": [], "bare": []}
    for i in range(args.repeats):
        for name, command in (("bare", bare), ("gpuflow", gpuflow)):
            results[name].append(measure(command, env, home, driver_is_ray=name == "bare"))
            print(f"run {i + 1} {name:8s} " + "  ".join(f"{k} {v:6.2f}s" for k, v in results[name][-1].items()), flush=True)
    medians = {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for name, runs in results.items()}
    print(f"\nmedians over {args.repeats} runs each (seconds)")
    print(f"{'':24s}{'bare':>10s}{'gpuflow':>10s}")
    for key in medians["bare"]:
        print(f"{key:24s}{medians['bare'][key]:10.2f}{medians['gpuflow'][key]:10.2f}")
    overhead = medians["gpuflow"]["wall"] - medians["bare"]["wall"]
    print(f"\ngpuflow fixed overhead: {overhead:.2f} s (target ≤ 5 s)")
    print(f"ratio gpuflow / bare:   {medians['gpuflow']['wall'] / medians['bare']['wall']:.3f} (target ≤ 1.15)")
    print(f"last step → last Ray process gone (gpuflow): {medians['gpuflow']['last_step_to_ray_gone']:.2f} s (target ≤ 5 s)")
    shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()

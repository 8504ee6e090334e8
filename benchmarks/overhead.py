"""gpuflow's fixed overhead: `gpuflow run` of the shipped digits spec against a bare Ray Train script, alternating.

    python benchmarks/overhead.py [--repeats 3] [--sides bare,bare-lean,gpuflow,second,warm]

The sides, one after the other in each round: `bare` (the script, its own ray.init, on Ray's defaults: the baseline
every ratio is against), `bare-lean` (the same with the lean settings gpuflow's local Ray starts with,
GPUFLOW_LOCAL_RAY), `gpuflow` (a cold `gpuflow run`: nothing of gpuflow's up; it starts Prefect's temporary API and a
Ray cluster of its own, and leaves the warm stack behind as it ends), `second` (the next `gpuflow run`, as soon as the
stack the cold one left has its API and spare up and has settled: seconds after it ended) and `warm` (`gpuflow run` on a
stack that has served runs already, as `gpuflow up` keeps it). The stack is down for `bare` and the cold run. Prints
medians of wall time, cluster up, first training step, last step → last Ray process of the run gone, each gpuflow side's
overhead (− bare) and ratio, the same round by round, and where each side's CPU time went during its run (every process
of the run, by role): on a machine with few cores, CPU-seconds are what the wall time is made of. All train the same
loop on the same data, read through Ray Data.
"""

import argparse
import collections
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from gpuflow.cluster.backends.local.early_job import LEAN_RAY

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "experiments" / "digits.yaml"
EPOCH = re.compile(r"\[gpuflow\] epoch \d+:|^epoch \d+/\d+ ")  # the bare script's line, gpuflow run's in a pipe


def started_for(home: Path) -> list[int]:
    """Every process started for this gpuflow home: all of them inherit GPUFLOW_HOME."""
    marker = f"GPUFLOW_HOME={home}\0".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def ray_processes(home: Path, exclude: int, started_before: float) -> list[int]:
    """Live Ray processes (daemons, workers, drivers, the job) started for this gpuflow home before a time: the warm
    stack's next spare, started after the run's cluster is down, is not the run's."""
    found = []
    for pid in started_for(home):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            created = psutil.Process(pid).create_time()
        except (OSError, psutil.Error):
            continue
        if (
            pid != exclude
            and state != "Z"
            and created < started_before
            and (b"ray" in command or b"gpuflow.cluster.job" in command)
        ):
            found.append(pid)
    return found


def role(process: psutil.Process) -> str:
    """What a process is for: Ray names its actors' processes (ray::TrainController), the rest by their module."""
    command = process.cmdline()
    if command and command[0].startswith("ray::"):
        return command[0].split(".")[0]
    text = " ".join(command)
    for needle, name in (
        ("gpuflow.flows.cli", "gpuflow run (flow)"),
        ("bare_ray_train", "bare script (driver)"),
        ("gpuflow.flows.local_stack.stack", "warm stack"),
        ("prefect", "prefect temporary API"),
        ("gpuflow.cluster.job", "gpuflow job (driver)"),
        ("gpuflow.cluster.spec.entrypoints", "loop import check"),
        ("local_ray", "cluster supervisor"),
        ("outlive", "gpuflow watchers"),
        ("gcs_server", "ray daemons"),
        ("raylet", "ray daemons"),
        ("dashboard", "ray daemons"),
        ("log_monitor", "ray daemons"),
        ("monitor.py", "ray daemons"),
        ("runtime_env", "ray daemons"),
    ):
        if needle in text:
            return name
    return text[:60]


class CpuByRole(threading.Thread):
    """Samples every process of the run (GPUFLOW_HOME in its environment) until stopped: CPU-seconds by role, spent
    during the run (a warm spare's daemons were started before it: their earlier seconds are not the run's)."""

    def __init__(self, home: Path, root_pid: int):
        super().__init__(daemon=True)
        self.home, self.root_pid = home, root_pid
        self.seen: dict[tuple[int, float], tuple[str, float]] = {}
        self.done = threading.Event()
        self.sample()
        self.before = {key: seconds for key, (_, seconds) in self.seen.items()}

    def sample(self) -> None:
        for pid in {self.root_pid, *started_for(self.home)}:
            try:
                process = psutil.Process(pid)
                times = process.cpu_times()
                self.seen[(process.pid, process.create_time())] = (role(process), times.user + times.system)
            except (OSError, psutil.Error):
                continue

    def run(self) -> None:
        while not self.done.wait(0.25):
            self.sample()

    def stop(self) -> dict[str, float]:
        self.sample()
        self.done.set()
        by_role = collections.Counter()
        for key, (name, seconds) in self.seen.items():
            by_role[name] += seconds - self.before.get(key, 0.0)
        return dict(by_role)


def measure(command: list[str], env: dict, home: Path, driver_is_ray: bool) -> dict:
    """Runs one command, timestamping its output lines; watches its Ray processes until the last is gone."""
    started = time.time()
    marks: dict[str, float] = {}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    exclude = -1 if driver_is_ray else process.pid
    cpu = CpuByRole(home, process.pid)
    cpu.start()
    gone_at = [None]
    training_over = threading.Event()

    def watch():
        training_over.wait()
        over_at = time.time()
        while ray_processes(home, exclude, over_at):
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
        if "training finished in" in line or "[bench] val_accuracy" in line:  # gpuflow's flow, the bare script
            training_over.set()
    process.wait()
    ended = time.time()
    training_over.set()
    watcher.join(timeout=60)
    cpu_by_role = cpu.stop()
    if process.returncode != 0:
        sys.exit("".join(output[-40:]) + f"\nbenchmark run failed: {command}")
    return {
        "wall": ended - started,
        "cluster_up": marks.get("cluster_up", float("nan")),
        "first_step": marks.get("first_step", float("nan")),
        "last_step_to_ray_gone": (gone_at[0] or ended) - marks.get("last_step_at", ended),
        "cpu_seconds": sum(cpu_by_role.values()),
        "cpu": cpu_by_role,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--sides",
        default="bare,bare-lean,gpuflow,second,warm",
        help="which of bare, bare-lean, gpuflow (cold), second, warm, in this order",
    )
    args = parser.parse_args()
    # Stopped early (a `timeout`, a kill), it still stops the warm stack it started: SIGTERM runs the finally below.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    sides = args.sides.split(",")
    home = Path(tempfile.mkdtemp(prefix="gpuflow-bench-"))
    env = {
        **os.environ,
        "GPUFLOW_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_HOME": str(home / "prefect"),
        "GPUFLOW_REUSE": "never",  # every run trains: the same spec again would reuse the finished run (no cluster)
    }
    env.pop("PREFECT_API_URL", None)
    python = sys.executable
    data = [f"data.train={home}/data/train.parquet", f"data.validation={home}/data/validation.parquet"]
    gpuflow_run = [
        python,
        "-m",
        "gpuflow.flows.cli",
        "run",
        str(SPEC),
        *[arg for item in data for arg in ("--set", item)],
    ]
    stack = [python, "-m", "gpuflow.flows.cli", "up", str(SPEC), "--idle-minutes", "60"]
    bare = [python, str(REPO / "benchmarks" / "bare_ray_train.py"), str(SPEC), *data]
    commands = {"bare": bare, "bare-lean": bare, "gpuflow": gpuflow_run, "second": gpuflow_run, "warm": gpuflow_run}
    down = [python, "-m", "gpuflow.flows.cli", "down"]
    # warm-up: writes the data, creates the MLflow store and Prefect's database
    measure(gpuflow_run, {**env, "GPUFLOW_STACK": "manual"}, home, False)
    results = {name: [] for name in sides}
    figures = {"repeats": args.repeats}  # for benchmarks/README.md; the gpuflow side is the cold run
    env["GPUFLOW_STACK"] = "auto"  # gpuflow's default: a cold run leaves the stack behind
    try:
        for i in range(args.repeats):
            for name in sides:
                if name in ("bare", "bare-lean", "gpuflow"):
                    subprocess.run(down, env=env, check=True, stdout=subprocess.DEVNULL)
                elif name == "second":
                    wait_for_left_stack(home)
                else:  # warm: the stack that is up, its next spare ready (or one of `gpuflow up`)
                    subprocess.run(stack, env=env, check=True, stdout=subprocess.DEVNULL)
                    settled(home)
                side_env = {**env, **LEAN_RAY} if name == "bare-lean" else env
                results[name].append(measure(commands[name], side_env, home, driver_is_ray=name.startswith("bare")))
                print(
                    f"run {i + 1} {name:8s} "
                    + "  ".join(f"{k} {v:6.2f}s" for k, v in results[name][-1].items() if k != "cpu"),
                    flush=True,
                )
        if "gpuflow" in sides:  # what the stack the last run left costs while it waits for the next
            wait_for_left_stack(home)
            figures.update(idle_cost(home))
    finally:
        subprocess.run(down, env=env, stdout=subprocess.DEVNULL)
    medians = {
        name: {key: statistics.median(r[key] for r in runs) for key in runs[0] if key != "cpu"}
        for name, runs in results.items()
    }
    print(f"\nmedians over {args.repeats} runs each (seconds)")
    print(f"{'':24s}" + "".join(f"{name:>10s}" for name in sides))
    for key in medians[sides[0]]:
        print(f"{key:24s}" + "".join(f"{medians[name][key]:10.2f}" for name in sides))
    print_cpu_breakdown(results)
    for name in sides:
        figures[f"{'cold' if name == 'gpuflow' else name} s"] = f"{medians[name]['wall']:.1f}"
        figures[f"{'cold' if name == 'gpuflow' else name} CPU-s"] = f"{medians[name]['cpu_seconds']:.1f}"
    if "bare" in sides:
        for name in [side for side in sides if side != "bare"]:
            overhead = medians[name]["wall"] - medians["bare"]["wall"]
            print(
                f"\n{name}: fixed overhead {overhead:.2f} s{' (target ≤ 5 s)' if name == 'gpuflow' else ''}, "
                f"ratio {medians[name]['wall'] / medians['bare']['wall']:.3f} "
                f"(target ≤ {1.15 if name == 'gpuflow' else 1.05}), "
                f"last step → last Ray process gone {medians[name]['last_step_to_ray_gone']:.2f} s (target ≤ 5 s)"
            )
            extra_cpu = print_rounds(results["bare"], results[name])
            label = "cold" if name == "gpuflow" else name
            figures.update(
                {
                    f"{label} overhead s": f"{overhead:.1f}",
                    f"{label} ratio": f"{medians[name]['wall'] / medians['bare']['wall']:.3f}",
                    f"{label} extra CPU-s": f"{extra_cpu:.1f}",
                }
            )
    shutil.rmtree(home, ignore_errors=True)
    sys.path.insert(0, str(REPO))
    from benchmarks.record import record

    record("overhead", figures)


def cpu_over(processes: list, seconds: float) -> float:
    """CPU-seconds the processes use over the next `seconds` (those that end meanwhile: until they end)."""
    before = {process.pid: sum(process.cpu_times()[:2]) for process in processes}
    time.sleep(seconds)
    return sum(sum(process.cpu_times()[:2]) - before[process.pid] for process in processes if process.is_running())


def idle_cost(home: Path, seconds: float = 30) -> dict[str, str]:
    """The idle stack's processes, memory (USS) and CPU (% of one core over `seconds`)."""
    processes = [psutil.Process(pid) for pid in started_for(home)]
    memory = sum(process.memory_full_info().uss for process in processes)
    used = cpu_over(processes, seconds)
    print(
        f"\nthe idle warm stack: {len(processes)} processes, {memory / 2**20:.0f} MiB (USS), "
        f"{100 * used / seconds:.1f} % of a core over {seconds:.0f} s"
    )
    return {
        "stack idle processes": str(len(processes)),
        "stack idle MiB": f"{memory / 2**20:.0f}",
        "stack idle CPU %": f"{100 * used / seconds:.1f}",
    }


def settled(home: Path, timeout_s: float = 30) -> None:
    """Until the stack's processes are quiet (the spare's daemons and its job done starting), at most `timeout_s`:
    a run started at once would share the CPU with the end of their start, which a person's next run seconds later
    would not."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cpu_over([psutil.Process(pid) for pid in started_for(home)], 1) < 0.2:
            return


def wait_for_left_stack(home: Path, timeout_s: float = 120) -> None:
    """Until the stack a cold run left behind has its API and spare up; exits if it left none."""
    deadline = time.monotonic() + timeout_s
    record = home / "stack" / "stack.json"
    while time.monotonic() < deadline:
        try:
            stack = json.loads(record.read_text())
            if stack.get("spare_shape") and psutil.pid_exists(stack["pid"]):
                return settled(home)
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        time.sleep(0.2)
    sys.exit(f"the cold run left no warm stack within {timeout_s:.0f}s: {home / 'stack' / 'stack.log'}")


def print_rounds(bare: list[dict], side: list[dict]) -> float:
    """Each round's difference (the two ran back to back, so a slower hour weighs on both), and what the extra
    CPU-seconds come to in wall time at the cores the bare run kept busy: on a machine with few cores, every
    CPU-second a gpuflow process spends is a share of wall time, even when it runs beside training."""
    walls = [b["wall"] for b in bare]
    behind = [s["wall"] - b["wall"] for b, s in zip(bare, side, strict=True)]
    extra_cpu = statistics.median(s["cpu_seconds"] - b["cpu_seconds"] for b, s in zip(bare, side, strict=True))
    busy = statistics.median(b["cpu_seconds"] / b["wall"] for b in bare)
    print(
        f"  round by round: {' / '.join(f'{d:+.1f}' for d in behind)} s against bare "
        f"({' / '.join(f'{w:.1f}' for w in walls)} s); median {statistics.median(behind):+.2f} s"
    )
    print(
        f"  extra CPU: {extra_cpu:+.1f} CPU-seconds a run (median of rounds); at the {busy:.2f} cores bare keeps "
        f"busy, that is {extra_cpu / busy:+.1f} s of wall time"
    )
    return extra_cpu


def print_cpu_breakdown(results: dict) -> None:
    """Median CPU-seconds per role, the sides in one table: the roles only gpuflow has are its overhead."""
    sides = list(results)
    last = sides[-1]
    roles = sorted(
        {name for runs in results.values() for run in runs for name in run["cpu"]},
        key=lambda name: -statistics.median(run["cpu"].get(name, 0) for run in results[last]),
    )
    print(f"\nCPU-seconds by process (median){'':6s}" + "".join(f"{name:>10s}" for name in sides))
    for name in roles:
        line = [statistics.median(run["cpu"].get(name, 0.0) for run in results[side]) for side in sides]
        if max(line) >= 0.5:
            print(f"{name:36s}" + "".join(f"{value:10.1f}" for value in line))


if __name__ == "__main__":
    main()

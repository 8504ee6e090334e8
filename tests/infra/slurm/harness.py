"""Local Slurm + SkyPilot test harness for gpuflow (tests/infra/slurm).

A one-node Slurm cluster on 127.0.0.1 that SkyPilot 0.14's Slurm cloud launches onto
(``infra="slurm/skyci"``). ``setup.sh`` / ``env.sh`` / ``teardown.sh`` in this folder do the
work; this module wraps them for pytest (the ``slurm_infra`` fixture in tests/conftest.py).

    from tests.infra.slurm import harness
    ok, why = harness.available()
    infra = harness.start()            # idempotent; ~20 s from scratch, <1 s if up
    subprocess.run(["gpuflow", "run", ...], env=infra.subprocess_env())
    assert harness.slurm_jobs() == [] and harness.sky_clusters(infra) == []
    harness.stop()
"""

from __future__ import annotations

import dataclasses
import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SSH_USER = "skyci"
SLURM_CLUSTER = "skyci"  # Host alias in ~/.slurm/config == SkyPilot region
INFRA = f"slurm/{SLURM_CLUSTER}"
# Env vars a *task* on this node needs (pass to sky.Task(envs=...)): one node on this
# machine, keep Ray on 127.0.0.1. A real multi-node cloud cluster must NOT set this.
NODE_TASK_ENVS = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def base_dir() -> Path:
    return Path(os.environ.get("GPUFLOW_SLURM_BASE", "/tmp/gpuflow-slurm"))


def _python() -> str:
    """Python whose environment has skypilot (the client side)."""
    return os.environ.get("GPUFLOW_PYTHON", sys.executable)


@dataclasses.dataclass
class SlurmInfra:
    base: Path
    env: dict[str, str]  # variables to add/override for a SkyPilot client subprocess
    infra: str = INFRA  # pass as sky.Resources(infra=...) / gpuflow's infra setting
    ssh_user: str = SSH_USER
    node_task_envs: dict[str, str] = dataclasses.field(default_factory=lambda: dict(NODE_TASK_ENVS))
    find_links: str = ""  # where pip/uv on the node find local wheels (torch +cpu)
    setup_seconds: float = 0.0

    def subprocess_env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """os.environ + the harness env: what `subprocess.run(..., env=...)` needs."""
        e = dict(os.environ)
        e.update(self.env)
        if extra:
            e.update(extra)
        return e


# --------------------------------------------------------------------------- checks
def _port_busy(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _pid_alive(pidfile: Path) -> bool:
    try:
        os.kill(int(pidfile.read_text().strip()), 0)
        return True
    except (OSError, ValueError):
        return False


def available(check_apt: bool = True) -> tuple[bool, str]:
    """Can the harness run here? (False, precise reason) instead of a mysterious failure."""
    if sys.platform != "linux":
        return False, f"needs Linux, not {sys.platform}"
    if os.geteuid() != 0:
        return False, "needs root (apt installs, useradd, slurmd/munged/sshd as root)"
    if not Path("/etc/debian_version").exists():
        return False, "needs a Debian/Ubuntu machine (apt packages slurmd, slurmctld, munge, ...)"
    for tool in ("bash", "runuser", "useradd"):
        if not shutil.which(tool):
            return False, f"'{tool}' not found"
    try:
        out = subprocess.run(
            [_python(), "-c", "import sky; print(sky.__version__)"], capture_output=True, text=True, timeout=120
        )
    except Exception as exc:  # noqa: BLE001
        return False, f"cannot run {_python()}: {exc}"
    if out.returncode != 0:
        return False, f"skypilot not importable by {_python()}: {out.stderr.strip()[-300:]}"
    if not out.stdout.strip().startswith("0.14"):
        return False, f"harness is written for skypilot 0.14.x, found {out.stdout.strip()}"
    b = base_dir()
    ours = {2222: b / "run/sshd.pid", 6817: b / "run/slurmctld.pid", 6818: b / "run/slurmd.pid"}
    port = int(os.environ.get("GPUFLOW_SLURM_SSH_PORT", "2222"))
    ours[port] = ours.pop(2222)
    for p, pf in ours.items():
        if _port_busy(p) and not _pid_alive(pf):
            return False, f"127.0.0.1:{p} is in use by something that is not this harness"
    installed = all(
        Path(p).exists()
        for p in (
            "/usr/sbin/slurmctld",
            "/usr/sbin/slurmd",
            "/usr/bin/sbatch",
            "/usr/sbin/munged",
            "/usr/sbin/sshd",
            "/usr/bin/rsync",
            "/usr/bin/patchelf",
        )
    )
    if not installed and check_apt:
        try:
            r = subprocess.run(["apt-get", "update", "-q"], capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            return False, "Slurm packages not installed and `apt-get update` timed out (no Debian mirror?)"
        if r.returncode != 0 or "Err:" in r.stdout:
            return False, (
                "Slurm packages not installed and the Debian mirror is not reachable: "
                + (r.stderr or r.stdout).strip()[-300:]
            )
    return True, "ok"


# --------------------------------------------------------------------------- lifecycle
def _harness_env() -> dict[str, str]:
    """Variables env.sh sets or changes (relative to the current environment)."""
    env = dict(os.environ)
    env["GPUFLOW_PYTHON"] = _python()
    out = subprocess.run(["bash", "-c", f'source "{HERE}/env.sh" && env -0'], env=env, capture_output=True, check=True)
    new = dict(kv.split("=", 1) for kv in out.stdout.decode().split("\0") if "=" in kv)
    new.pop("_", None)
    always = ("HOME", "PATH", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE")
    diff = {
        k: v for k, v in new.items() if os.environ.get(k) != v or k in always or k.startswith(("SKYPILOT_", "GPUFLOW_"))
    }
    diff["GPUFLOW_PYTHON"] = _python()
    return diff


def start(timeout: float = 900) -> SlurmInfra:
    """Run setup.sh (idempotent) and return the infra description."""
    t0 = time.monotonic()
    env = dict(os.environ, GPUFLOW_PYTHON=_python())
    r = subprocess.run(["bash", str(HERE / "setup.sh")], env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(
            f"tests/infra/slurm/setup.sh failed (rc={r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        )
    henv = _harness_env()
    fl = ""
    prof = base_dir() / "home" / SSH_USER / ".profile"
    for line in prof.read_text().splitlines():
        if line.startswith("export PIP_FIND_LINKS="):
            fl = line.split("=", 1)[1].strip('"')
    return SlurmInfra(base=base_dir(), env=henv, find_links=fl, setup_seconds=time.monotonic() - t0)


def stop() -> str:
    """Run teardown.sh: sky api stop, ssh ControlMaster, scancel, skyci processes, daemons."""
    env = dict(os.environ, GPUFLOW_PYTHON=_python())
    r = subprocess.run(["bash", str(HERE / "teardown.sh")], env=env, capture_output=True, text=True, timeout=300)
    return r.stdout + r.stderr


# --------------------------------------------------------------------------- probes
def slurm_jobs(user: str | None = None) -> list[dict[str, str]]:
    """Jobs in squeue (all users by default): [{'id','user','name','state'}]."""
    cmd = ["squeue", "-h", "-o", "%i|%u|%j|%T"] + (["-u", user] if user else [])
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
    return [
        dict(zip(("id", "user", "name", "state"), ln.split("|"), strict=True)) for ln in out.splitlines() if ln.strip()
    ]


def sky_clusters(infra: SlurmInfra | None = None, refresh: bool = False) -> list[str]:
    """Names of SkyPilot clusters known to the harness's (isolated) SkyPilot client."""
    return [r["name"] for r in sky_status(infra, refresh)]


def sky_status(infra: SlurmInfra | None = None, refresh: bool = False) -> list[dict]:
    """`sky status` records of the harness's SkyPilot client: name, status, autostop (minutes), to_down."""
    env = infra.subprocess_env() if infra else dict(os.environ, **_harness_env())
    mode = "sky.StatusRefreshMode.FORCE" if refresh else "sky.StatusRefreshMode.NONE"
    code = (
        "import json, sky\n"
        f"recs = sky.get(sky.status(refresh={mode}))\n"
        "print('SKY_CLUSTERS=' + json.dumps([{'name': r['name'], 'status': r['status'].value,\n"
        "    'autostop': r['autostop'], 'to_down': r['to_down']} for r in recs]))\n"
    )
    r = subprocess.run([_python(), "-c", code], env=env, capture_output=True, text=True, timeout=300)
    for ln in r.stdout.splitlines():
        if ln.startswith("SKY_CLUSTERS="):
            return json.loads(ln.split("=", 1)[1])
    raise RuntimeError(f"sky status failed (rc={r.returncode}): {r.stderr[-2000:]}")


def leftover_processes() -> list[str]:
    """Processes still owned by the harness user (Ray daemons escaping a job, ...)."""
    try:
        uid = pwd.getpwnam(SSH_USER).pw_uid
    except KeyError:
        return []
    out = subprocess.run(["ps", "-o", "pid=,args=", "-U", str(uid)], capture_output=True, text=True)
    return [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]

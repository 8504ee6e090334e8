#!/bin/bash
# Stop everything setup.sh and the tests started: by pid file or by the harness's own
# user (skyci), never by process name. Leaves state on disk (rm -rf $GPUFLOW_SLURM_BASE
# to wipe; PURGE_UV_CACHE=1 also drops SkyPilot's uv cache of the skyci user).
HERE=$(cd "$(dirname "$0")" && pwd)
BASE=${GPUFLOW_SLURM_BASE:-/tmp/gpuflow-slurm}
CLIENT_HOME=${CLIENT_HOME:-$BASE/clienthome}
PY=${GPUFLOW_PYTHON:-python3}
SSH_USER=skyci
# 1. SkyPilot local API server (auto-started by the SDK under HOME=$CLIENT_HOME, own port)
if [ -d $CLIENT_HOME/.sky ]; then
  SKY=$(dirname "$PY")/sky; command -v "$SKY" >/dev/null || SKY=$(command -v sky || true)
  if [ -n "$SKY" ]; then
    ( source $HERE/env.sh; timeout 60 "$SKY" api stop ) >/dev/null 2>&1 || true
  fi
fi
# 1a. SkyPilot client-side helpers that outlive the API server (subprocess_daemon.py, or
#     the server itself if `api stop` failed): only processes whose HOME is our CLIENT_HOME.
for p in $(pgrep -f 'sky[./]' 2>/dev/null); do
  [ "$p" = "$$" ] && continue
  if tr '\0' '\n' < /proc/$p/environ 2>/dev/null | grep -qx "HOME=$CLIENT_HOME"; then
    echo "stopping SkyPilot client process $p: $(tr '\0' ' ' < /proc/$p/cmdline | cut -c1-100)"; kill $p 2>/dev/null
  fi
done
# 1b. SkyPilot's persistent ssh ControlMaster(s) to the login node (this client's hash dir)
UH=$(cat $CLIENT_HOME/.sky/user_hash 2>/dev/null)
if [ -n "$UH" ] && [ -d /tmp/sky_ssh_$UH ]; then
  for s in $(find /tmp/sky_ssh_$UH -type s 2>/dev/null); do ssh -o ControlPath=$s -O exit skyci-login >/dev/null 2>&1; done
  rm -rf /tmp/sky_ssh_$UH
fi
# 2. Slurm jobs of the test user, then any process still owned by it (Ray daemons started
#    by a job double-fork out of Slurm's process tracking)
if id $SSH_USER >/dev/null 2>&1; then
  scancel -u $SSH_USER 2>/dev/null || true
  for i in $(seq 1 20); do [ -z "$(squeue -h -u $SSH_USER 2>/dev/null)" ] && break; sleep 0.5; done
  pids=$(pgrep -u $SSH_USER 2>/dev/null | tr '\n' ' ')
  if [ -n "$pids" ]; then
    echo "killing leftover $SSH_USER processes: $pids"; kill $pids 2>/dev/null; sleep 2
    pids=$(pgrep -u $SSH_USER 2>/dev/null | tr '\n' ' '); [ -n "$pids" ] && kill -9 $pids 2>/dev/null
  fi
fi
# 2b. SkyPilot's scratch files of the test user in /tmp (sky_app_*, sky_setup_*, uv locks)
if id $SSH_USER >/dev/null 2>&1; then
  find /tmp -maxdepth 1 -user $SSH_USER ! -name "uv_cache_*" -exec rm -rf {} + 2>/dev/null
fi
# 3. daemons the harness started (pid files written by setup.sh / the daemons' own configs)
for pf in $BASE/run/sshd.pid $BASE/run/slurmd.pid $BASE/run/slurmctld.pid $BASE/run/munged.pid; do
  if [ -f "$pf" ]; then
    p=$(cat "$pf")
    if kill "$p" 2>/dev/null; then
      for i in $(seq 1 40); do kill -0 "$p" 2>/dev/null || break; sleep 0.25; done
      echo "stopped $(basename $pf .pid) ($p)"
    fi
    rm -f "$pf"
  fi
done
# 4. optional: SkyPilot's hard-coded uv cache of the test user (keep it: reruns are faster)
[ "${PURGE_UV_CACHE:-0}" = 1 ] && rm -rf /tmp/uv_cache_$(id -u $SSH_USER 2>/dev/null || echo none)
true

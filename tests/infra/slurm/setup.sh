#!/bin/bash
# gpuflow test harness: bring up a one-node Slurm cluster on 127.0.0.1 that SkyPilot's
# Slurm cloud can use (infra="slurm/skyci"). Idempotent: re-running only starts what is
# not running. Needs root, Debian 12, and the Debian + PyPI package registries.
#
#   munged + slurmctld + slurmd (this machine is the only node, NodeAddr=127.0.0.1)
#   user `skyci` (SkyPilot ssh-es in as it and edits its authorized_keys/.bashrc)
#   a private sshd on 127.0.0.1:$GPUFLOW_SLURM_SSH_PORT (the Slurm "login node")
#   client side: $CLIENT_HOME/.slurm/config, $CLIENT_HOME/.sky/config.yaml, ssh key
#
# All state lives under $GPUFLOW_SLURM_BASE (default /tmp/gpuflow-slurm), except what
# Debian's packages fix: /etc/slurm/slurm.conf (written here), /etc/munge/munge.key and
# /run/munge (munge's defaults, which the Slurm client tools expect).
set -euo pipefail
T0=$SECONDS
HERE=$(cd "$(dirname "$0")" && pwd)
BASE=${GPUFLOW_SLURM_BASE:-/tmp/gpuflow-slurm}
CLIENT_HOME=${CLIENT_HOME:-$BASE/clienthome}
SSH_PORT=${GPUFLOW_SLURM_SSH_PORT:-2222}
SSH_USER=skyci
CLUSTER=skyci                       # ~/.slurm/config Host alias == SkyPilot region
SKYCI_HOME=$BASE/home/$SSH_USER
PY=${GPUFLOW_PYTHON:-python3}       # only used to fetch the `uv` wheel from PyPI
# Where pip/uv on the node find local wheels (torch 2.13.0+cpu). Empty: PyPI only.
FIND_LINKS=${GPUFLOW_SLURM_FIND_LINKS-$( [ -d /opt/wheels ] && echo /opt/wheels || true )}
log() { echo "[setup +$((SECONDS-T0))s] $*"; }

[ "$(id -u)" = 0 ] || { echo "setup.sh must run as root" >&2; exit 2; }
mkdir -p $BASE/run $BASE/log $BASE/ssh $BASE/shims $BASE/home $BASE/slurm/ctld $BASE/slurm/d
chmod 755 $BASE $BASE/home

# 1. packages (Debian 12: Slurm 22.05.8, munge 0.5.15, OpenSSH 9.2)
need=0
for b in /usr/sbin/slurmctld /usr/sbin/slurmd /usr/bin/sbatch /usr/sbin/munged /usr/sbin/sshd \
         /usr/bin/ssh /usr/bin/rsync /usr/bin/patchelf /usr/bin/curl; do
  [ -x $b ] || need=1
done
if [ $need = 1 ]; then
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
    slurmctld slurmd slurm-client munge openssh-server openssh-client rsync patchelf curl ca-certificates
fi
log "packages ok"

# 2. offline helpers: uv's installer and CPython downloads come from astral.sh / GitHub,
#    unreachable here. The uv binary comes from PyPI's `uv` wheel and is served to
#    SkyPilot by a curl shim (SkyPilot runs `curl -LsSf https://astral.sh/uv/install.sh | sh`
#    on every new cluster). SkyPilot asks uv for CPython 3.10: with PY310_SRC (a python
#    3.10 prefix) it is copied here; otherwise a wrapper maps 3.10 -> the system python3.11.
if [ ! -x $BASE/uv/uv ]; then
  mkdir -p $BASE/uv $BASE/dl
  $PY -m pip download -q --no-deps -d $BASE/dl uv
  BASE=$BASE $PY - <<'PY'
import glob, os, zipfile
w = sorted(glob.glob(os.environ['BASE'] + '/dl/uv-*.whl'))[-1]
z = zipfile.ZipFile(w)
for n in z.namelist():
    if '/scripts/' in n:
        open(os.environ['BASE'] + '/uv/' + n.rsplit('/', 1)[1], 'wb').write(z.read(n))
PY
  chmod 755 $BASE/uv/uv $BASE/uv/uvx
fi
rm -rf $BASE/uv/bin && mkdir -p $BASE/uv/bin
PY310_SRC=${PY310_SRC:-}
if [ -n "$PY310_SRC" ] && [ -x "$PY310_SRC/bin/python3.10" ]; then
  if [ ! -x $BASE/py310/bin/python3.10 ]; then
    cp -a "$PY310_SRC" $BASE/py310
    patchelf --set-rpath '$ORIGIN/../lib' $BASE/py310/bin/python3.10
    chmod -R a+rX $BASE/py310
  fi
  cp -p $BASE/uv/uv $BASE/uv/uvx $BASE/uv/bin/
  log "SkyPilot runtime python: 3.10 ($PY310_SRC)"
else
  cp -p $BASE/uv/uv $BASE/uv/bin/uv.real
  cp -p $BASE/uv/uvx $BASE/uv/bin/
  install -m 755 $HERE/uv-py311-wrapper $BASE/uv/bin/uv
  log "SkyPilot runtime python: /usr/bin/python3.11 (uv wrapper maps --python 3.10 -> 3.11)"
fi
sed "s#@BASE@#$BASE#g" $HERE/curl-shim > $BASE/shims/curl && chmod 755 $BASE/shims/curl
chmod -R a+rX $BASE/uv $BASE/shims
log "offline helpers ok ($($BASE/uv/uv --version))"

# 3. munge (Debian defaults: key in /etc/munge, socket + pid in /run/munge)
mkdir -p /run/munge && chown munge:munge /run/munge && chmod 755 /run/munge
if ! [ -s /etc/munge/munge.key ]; then
  /usr/sbin/mungekey --create -f 2>/dev/null || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
  chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key
fi
if ! [ -S /run/munge/munge.socket.2 ] || ! munge -n >/dev/null 2>&1; then
  runuser -u munge -- /usr/sbin/munged
  # remember that *we* started it (teardown only stops what the harness started)
  for i in $(seq 1 20); do [ -s /run/munge/munged.pid ] && break; sleep 0.1; done
  cp /run/munge/munged.pid $BASE/run/munged.pid
fi
munge -n | unmunge >/dev/null && log "munge ok"

# 4. slurm
HOST=$(hostname -s); CPUS=$(nproc)
MEM=$(( $(awk '/MemTotal/{print $2}' /proc/meminfo) / 1024 * 8 / 10 ))
mkdir -p /etc/slurm
sed -e "s/@HOST@/$HOST/g" -e "s/@CPUS@/$CPUS/g" -e "s/@MEM@/$MEM/g" -e "s#@BASE@#$BASE#g" \
  $HERE/slurm.conf.tmpl > $BASE/slurm.conf
cmp -s $BASE/slurm.conf /etc/slurm/slurm.conf || cp $BASE/slurm.conf /etc/slurm/slurm.conf
alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
alive $BASE/run/slurmctld.pid || /usr/sbin/slurmctld -c   # -c: clean start, no saved state
alive $BASE/run/slurmd.pid || /usr/sbin/slurmd
ok=0
for i in $(seq 1 60); do
  if sinfo -h -N -o '%T' 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then ok=1; break; fi
  sleep 0.5
done
[ $ok = 1 ] || { sinfo || true; tail -20 $BASE/log/slurmctld.log $BASE/log/slurmd.log; echo "slurm did not come up" >&2; exit 1; }
log "slurm ok: $(sinfo -h -o '%P %a %D %T %c cpus %m MB')"

# 5. login-node user + private sshd on 127.0.0.1:$SSH_PORT
if ! id $SSH_USER >/dev/null 2>&1; then
  useradd -m -d $SKYCI_HOME -s /bin/bash $SSH_USER
elif [ "$(getent passwd $SSH_USER | cut -d: -f6)" != "$SKYCI_HOME" ]; then
  usermod -d $SKYCI_HOME $SSH_USER
fi
mkdir -p $SKYCI_HOME && chown $SSH_USER:$SSH_USER $SKYCI_HOME
usermod -p '*' $SSH_USER   # not "locked" (sshd with UsePAM=no refuses '!' accounts)
for f in .profile .bashrc; do [ -f $SKYCI_HOME/$f ] || { cp /etc/skel/$f $SKYCI_HOME/$f 2>/dev/null || touch $SKYCI_HOME/$f; chown $SSH_USER:$SSH_USER $SKYCI_HOME/$f; }; done
if ! grep -q 'SkyPilot-on-local-Slurm' $SKYCI_HOME/.profile; then
  sed -e "s#@BASE@#$BASE#g" -e "s#@FIND_LINKS@#$FIND_LINKS#g" $HERE/profile_snippet.tmpl >> $SKYCI_HOME/.profile
fi
mkdir -p $CLIENT_HOME/.ssh $CLIENT_HOME/.slurm $CLIENT_HOME/.sky && chmod 700 $CLIENT_HOME/.ssh
[ -f $CLIENT_HOME/.ssh/skyci_key ] || ssh-keygen -q -t ed25519 -N '' -C gpuflow-slurm-harness -f $CLIENT_HOME/.ssh/skyci_key
install -d -m 700 -o $SSH_USER -g $SSH_USER $SKYCI_HOME/.ssh
touch $SKYCI_HOME/.ssh/authorized_keys
grep -qF "$(cat $CLIENT_HOME/.ssh/skyci_key.pub)" $SKYCI_HOME/.ssh/authorized_keys || cat $CLIENT_HOME/.ssh/skyci_key.pub >> $SKYCI_HOME/.ssh/authorized_keys
chown $SSH_USER:$SSH_USER $SKYCI_HOME/.ssh/authorized_keys; chmod 600 $SKYCI_HOME/.ssh/authorized_keys
[ -f $BASE/ssh/ssh_host_ed25519_key ] || ssh-keygen -q -t ed25519 -N '' -f $BASE/ssh/ssh_host_ed25519_key
mkdir -p /run/sshd && chmod 755 /run/sshd
sed -e "s#@BASE@#$BASE#g" -e "s#@SSH_PORT@#$SSH_PORT#g" -e "s#@SSH_USER@#$SSH_USER#g" \
  $HERE/sshd_config.tmpl > $BASE/run/sshd_config
# started, then checked to listen: once in a dozen whole matrices it was gone within a second of its start ("Received
# signal 15"), sender unknown; one more start, said in the log, spares the Slurm tier's every test an error
listening() { (exec 3<>/dev/tcp/127.0.0.1/$SSH_PORT) 2>/dev/null; }
for try in 1 2; do
  alive $BASE/run/sshd.pid || /usr/sbin/sshd -f $BASE/run/sshd_config -E $BASE/log/sshd.log
  for _ in $(seq 20); do listening && break; sleep 0.1; done
  sleep 0.5; listening && alive $BASE/run/sshd.pid && break
  log "sshd is not listening after its start (try $try): $(tail -2 $BASE/log/sshd.log | tr '\n' ' ')"
done
sed -e "s#@CLIENT_HOME@#$CLIENT_HOME#g" -e "s#@SSH_PORT@#$SSH_PORT#g" -e "s#@SSH_USER@#$SSH_USER#g" \
    -e "s#@CLUSTER@#$CLUSTER#g" $HERE/slurm_ssh_config.tmpl > $CLIENT_HOME/.slurm/config
cp $HERE/sky_config.yaml $CLIENT_HOME/.sky/config.yaml
log "sshd on 127.0.0.1:$SSH_PORT ok"

# 6. check the login path exactly as SkyPilot uses it (ssh -> login shell -> slurm tools)
ssh -o BatchMode=yes -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR \
    -o ConnectTimeout=10 -i $CLIENT_HOME/.ssh/skyci_key -p $SSH_PORT $SSH_USER@127.0.0.1 \
    'bash --login -c "echo login-ok as \$(id -un); command -v curl; sinfo -h -o %P:%T; srun -N1 -t 1 hostname"'
# the smoke job may linger in COMPLETING while slurmd runs its epilogue: the harness starts empty
for _ in $(seq 60); do [ -z "$(squeue -h -o %i)" ] && break; sleep 1; done
[ -z "$(squeue -h -o %i)" ] || { squeue; echo "setup: the smoke job did not leave the queue in 60 s" >&2; exit 1; }
log "done (BASE=$BASE, infra=slurm/$CLUSTER)"

# source me (bash): environment for a SkyPilot *client* that uses the local Slurm harness.
# harness.py derives SlurmInfra.env from this file, so it is the single source of truth.
# Activate (or set GPUFLOW_PYTHON to) the Python environment that has skypilot first.
export GPUFLOW_SLURM_BASE=${GPUFLOW_SLURM_BASE:-/tmp/gpuflow-slurm}
export CLIENT_HOME=${CLIENT_HOME:-$GPUFLOW_SLURM_BASE/clienthome}
# Isolated client state: ~/.sky (API server db, logs, user_hash), ~/.slurm/config, ssh key.
# The invoking user's ~/.sky is never touched.
export HOME=$CLIENT_HOME
# Own local API server port, so it can never be (or be mistaken for) another SkyPilot
# API server on this machine (default 46580).
export SKYPILOT_API_SERVER_LOCAL_PORT=${GPUFLOW_SKY_API_PORT:-46590}
unset SKYPILOT_API_SERVER_ENDPOINT
export SKYPILOT_DISABLE_USAGE_COLLECTION=1
export SKYPILOT_DEBUG=${SKYPILOT_DEBUG:-0}
# System CA bundle (PyPI is behind a TLS-intercepting proxy here)
export SSL_CERT_FILE=${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}
export REQUESTS_CA_BUNDLE=${REQUESTS_CA_BUNDLE:-$SSL_CERT_FILE}
# `sky` CLI of the chosen Python on PATH
if [ -n "${GPUFLOW_PYTHON:-}" ]; then export PATH=$(dirname "$GPUFLOW_PYTHON"):$PATH; fi
# What gpuflow should use as SkyPilot infra
export GPUFLOW_SLURM_INFRA=slurm/skyci
# Keep tools that follow HOME from writing outside the harness
export XDG_CACHE_HOME=$CLIENT_HOME/.cache XDG_CONFIG_HOME=$CLIENT_HOME/.config

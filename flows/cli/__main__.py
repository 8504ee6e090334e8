"""`python -m gpuflow.flows.cli`: the gpuflow command, where its script is not on PATH."""

from gpuflow.flows.cli import entry

entry()

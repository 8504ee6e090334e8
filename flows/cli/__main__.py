"""`python -m gpuflow.flows.cli`: the gpuflow command, where its script is not on PATH."""

import sys

from gpuflow.flows.cli import main

sys.exit(main())

"""The spec's `notify:`: who hears about a run's failures and stops (a Prefect Custom Webhook block, by name)."""

from __future__ import annotations

import re

from pydantic import Field, StrictBool, field_validator

from gpuflow.cluster.spec.fields import Strict

BLOCK_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,99}$")


class NotifySpec(Strict):
    block: str = Field(
        description="Name of a Prefect Custom Webhook block to message (`gpuflow notify add NAME URL` "
        "makes one, in a generic or Slack's format): on Failed, Crashed, every stopped_by and each "
        "recovery from a lost cluster."
    )
    completed: StrictBool = Field(False, description="Also message when a run completes.")

    @field_validator("block")
    @classmethod
    def _block_name(cls, value: str) -> str:
        if not BLOCK_NAME.match(value):
            raise ValueError(f"{value!r} is not a block name: lowercase letters, digits and '-', e.g. 'team-alerts'")
        return value

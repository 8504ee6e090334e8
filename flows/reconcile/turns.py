"""One process at a time, across machines: a one-slot global concurrency limit on the Prefect server they share,
whose slot decays, so that a holder that dies never keeps it (the recount's turn, the messages' turn, the overdue
pass's asker)."""

from __future__ import annotations

import contextlib
import time


def take_a_turn(client, name: str, decay_s: float) -> bool:
    """Takes the one slot of limit `name` (made on first use, its slot gone within `decay_s`); False when another
    process holds it."""
    import httpx
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    try:  # read first: the server logs a traceback for every create of a limit that exists (each pass, each command)
        client.read_global_concurrency_limit_by_name(name)
    except ObjectNotFound:
        with contextlib.suppress(ObjectAlreadyExists):  # another process made it meanwhile
            client.create_global_concurrency_limit(
                GlobalConcurrencyLimitCreate(name=name, limit=1, slot_decay_per_second=1 / decay_s)
            )
    try:
        client.increment_concurrency_slots(names=[name], slots=1, mode="concurrency")
        return True
    except httpx.HTTPStatusError as exc:
        if exc.response.status_code != 423:  # 423: the slot is held
            raise
        return False


class Turn:
    """`with Turn(client, name, decay_s) as ours`: True when this process has the turn, False when another has; the
    slot is given back at the end, unless it decayed meanwhile (and may be another's now)."""

    def __init__(self, client, name: str, decay_s: float):
        self.client, self.name, self.decay_s, self.ours = client, name, decay_s, False

    def __enter__(self) -> bool:
        self.ours = take_a_turn(self.client, self.name, self.decay_s)
        self.taken = time.monotonic()
        return self.ours

    def __exit__(self, *exc) -> None:
        if self.ours and time.monotonic() - self.taken < self.decay_s:
            self.client.release_concurrency_slots(names=[self.name], slots=1, occupancy_seconds=None)

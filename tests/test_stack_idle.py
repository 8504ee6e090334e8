"""When the warm stack stops itself: its idle time counts from the last run it saw, local or on its API only."""

from gpuflow.cluster.run.liveness import beating, silent_for
from gpuflow.flows.local_stack.idle import IdleClock

IDLE_S = 600.0


class Api:
    """The stack's API, used by one run (SkyPilot's, or one waiting for the quota) from 0 until `ends_at`."""

    def __init__(self, ends_at: float | None):
        self.ends_at, self.now, self.asked = ends_at, 0.0, 0

    def since_used(self) -> float | None:
        self.asked += 1
        if self.ends_at is None:
            return None
        return max(0.0, self.now - self.ends_at)


def first_stop(clock: IdleClock, api: Api, until: float = 10_000.0) -> float:
    """The stack's loop, a tick a second: when it stops."""
    now = 0.0
    while now < until:
        api.now = now
        if clock.idle_out(now, api.since_used):
            return now
        now += 1.0
    raise AssertionError("never stopped")


def test_a_run_on_the_api_keeps_the_stack_for_its_idle_time_after_the_run_ends():
    # right after an ask, right before one: the old clock (one ask per idle time) stopped 0 to 600 s after these
    for ends_at in (300.0, 599.0, 602.0, 1199.0, 1203.0, 3000.0):
        api = Api(ends_at)
        assert first_stop(IdleClock(IDLE_S, 0.0), api) == ends_at + IDLE_S + 1, ends_at
        assert api.asked <= ends_at // IDLE_S + 2, "asked about once per idle time, not every tick"


def test_an_idle_stack_stops_after_its_idle_time():
    api = Api(ends_at=None)  # no run on its API
    assert first_stop(IdleClock(IDLE_S, 0.0), api) == IDLE_S + 1
    assert api.asked == 1


def test_a_local_run_keeps_the_stack_without_asking_the_api():
    clock, api = IdleClock(IDLE_S, 0.0), Api(ends_at=None)
    for now in range(0, 2000, 10):
        clock.busy(float(now))  # a local cluster of a run is up
        assert not clock.idle_out(float(now), api.since_used)
    assert api.asked == 0
    assert first_stop(clock, api, until=5000.0) == 1990 + IDLE_S + 1


def test_a_run_with_no_heartbeat_yet_is_judged_by_its_state_age_as_the_reaper_judges_it():
    assert beating(silent_for(state_age_s=5.0, heartbeat_age_s=None))  # just created: it lives
    assert not beating(silent_for(state_age_s=900.0, heartbeat_age_s=None))  # never said a word
    assert not beating(silent_for(state_age_s=5.0, heartbeat_age_s=900.0))  # its heartbeats stopped
    assert beating(silent_for(state_age_s=900.0, heartbeat_age_s=10.0))

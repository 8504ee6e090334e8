"""As a person would: open a sweep's parent run in the MLflow UI's runs table, expand it, and find its trials.

apt-get install -y chromium && .venv/bin/python -m pytest --full -m browser tests/ui/test_sweep_in_mlflow.py
"""

import re

import pytest

from tests.support.runs import mlflow_run_of
from tests.test_sweep import children_of

pytestmark = pytest.mark.browser
# The runs table's expander beside a parent run (MLflow 3's run-name cell); children rows appear under it once open.
EXPANDER = "button[data-component-id$='runnamecellrenderer.tsx_46']"


def test_a_sweeps_trials_are_nested_under_its_parent_run(tracked_sweep, mlflow_url, page):
    """The sweep is the one test_sweep.py reads (tests/conftest.py's tracked_sweep), tracked on the MLflow server."""
    page, shot = page
    spec, state = tracked_sweep.spec, tracked_sweep.state
    assert state.is_completed(), state.message
    client, parent = mlflow_run_of(spec.tracking_uri, state.state_details.flow_run_id, spec.experiment_name)
    trials = children_of(client, parent)
    assert len(trials) == 4

    page.goto(f"{mlflow_url}/#/experiments")
    page.get_by_role("button", name="Model training").click()  # the default GenAI mode opens on traces
    page.get_by_role("link", name=spec.experiment_name, exact=True).click()
    page.get_by_role("link", name=parent.info.run_name, exact=True).first.wait_for()
    shot("sweep-parent-run")
    for trial in trials:  # nested: not rows of their own until the parent is opened
        assert not page.get_by_role("link", name=trial.info.run_name, exact=True).is_visible()
    page.locator(EXPANDER).first.click()
    for trial in trials:
        page.get_by_role("link", name=trial.info.run_name, exact=True).first.wait_for()
    shot("sweep-trials-under-the-parent")

    page.get_by_role("link", name=parent.info.run_name, exact=True).first.click()
    page.get_by_role("tab", name="Overview").first.wait_for()
    page.get_by_text(re.compile(r"best_score")).first.wait_for()  # the winner's score, on the parent
    shot("sweep-parent-overview")

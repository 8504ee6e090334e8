"""As a person would: open a sweep's parent run in the MLflow UI's runs table, expand it, and find its trials.

    apt-get install -y chromium && .venv/bin/python -m pytest --full -m browser tests/ui/test_sweep_in_mlflow.py
"""

import re

import pytest

from gpuflow.cluster.spec import parse_spec
from gpuflow.flows.experiment import run_experiment
from tests.conftest import processes_of
from tests.test_sweep import children_of, mlflow_run_of_parent, tunable_sweep

pytestmark = pytest.mark.browser
# The runs table's expander beside a parent run (MLflow 3's run-name cell); children rows appear under it once open.
EXPANDER = "button[data-component-id$='runnamecellrenderer.tsx_46']"


def test_a_sweeps_trials_are_nested_under_its_parent_run(prefect_server, mlflow_url, gpuflow_home, page):
    page, shot = page
    fields = tunable_sweep(parameters={"train.lr": {"grid": [0.1, 0.01]}})  # 2 short trials, no early stopping
    del fields["sweep"]["early_stopping"]
    fields.update(name="tunable-ui", tracking={"uri": mlflow_url}, train={**fields["train"], "epochs": 2})
    spec = parse_spec(fields)
    state = run_experiment(spec, return_state=True)
    assert state.is_completed(), state.message
    assert processes_of(gpuflow_home) == []
    client, parent = mlflow_run_of_parent(spec, state.state_details.flow_run_id)
    trials = children_of(client, parent)
    assert len(trials) == 2

    page.goto(f"{mlflow_url}/#/experiments")
    page.get_by_role("button", name="Model training").click()  # the default GenAI mode opens on traces
    page.get_by_role("link", name="tunable-ui", exact=True).click()
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

"""As a person would: start a run from the Prefect UI's form, watch it complete, then find it in the MLflow UI.

apt-get install -y chromium && .venv/bin/python -m pytest --full -m browser tests/ui   # screenshots: test-artifacts/ui/
"""

import contextlib
import re
import time
import uuid

import pytest

from tests.support.processes import wait_until
from tests.support.runs import mlflow_run_of

pytestmark = pytest.mark.browser
PlaywrightTimeout = pytest.importorskip("playwright.sync_api").TimeoutError

RUN_TIMEOUT_MS = 900_000  # a full run on a shared 2-core machine; never a timing assertion
PAGE_LOAD_MS = 240_000  # the Prefect UI's first load, beside the other lanes' runs
UI_RUN: dict = {}  # the flow run the first test starts from the UI, for the MLflow tests after it


def test_custom_run_from_the_prefect_ui(served, page):
    page, shot = page
    page.goto(f"{served.ui_url}/v2/deployments")
    open_deployment(page, "run-experiment")
    page.get_by_role("button", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Custom run").click()
    epochs = page.get_by_label("Epochs (Optional)", exact=True)
    epochs.fill("3")
    epochs.scroll_into_view_if_needed()
    shot("custom-run-form-epochs-3")
    deployment_id = served.deployment("run-experiment").id
    before = {run.id for run in runs_of(served, deployment_id)}
    flow_run_id = submit_until_a_run_exists(
        page,
        shot,
        lambda: [
            run.id
            for run in sorted(runs_of(served, deployment_id), key=lambda run: run.created)
            if run.id not in before
        ],
    )
    try:
        page.get_by_role("link", name="View run").click(timeout=10_000)
    except PlaywrightTimeout:  # the toast is gone (a busy machine renders slowly): open the run the form made
        page.goto(f"{served.ui_url}/v2/runs/flow-run/{flow_run_id}")  # the new UI's, where the form is

    # The URL changes before the content: wait for a tab only the flow-run page has, then read its state badge.
    page.get_by_role("tab", name="Job Variables").wait_for()
    # a second Submit (the first was slow, not lost) makes a second run: the page shows one the form made
    opened = re.search(r"/flow-run/([0-9a-f-]{36})", page.url).group(1)
    made = {str(run.id) for run in runs_of(served, deployment_id) if run.id not in before}
    assert opened in made, (opened, made)
    flow_run_id, run_page = uuid.UUID(opened), page.url  # the new UI's page (/v2/...), as the form opened it
    # While the run trains, the page is left: a live flow-run page keeps Chromium rendering its logs, a third of a
    # core that the run and the other tests need. The page is opened again once the run has ended.
    page.goto("about:blank")
    with served.client() as client:
        wait_until(
            lambda: client.read_flow_run(flow_run_id).state.is_final(),
            RUN_TIMEOUT_MS / 1000,
            f"flow run {flow_run_id} over (see {served.home / 'serve.log'})",
            interval_s=2,
        )
    page.goto(run_page)
    page.get_by_role("tab", name="Job Variables").wait_for(timeout=PAGE_LOAD_MS)  # the whole UI loads again
    # The run's tags are badges too (experiment:..., backend:...): look for the one that holds a final state.
    state = page.locator('[data-slot="badge"]', has_text=re.compile(r"^\s*(Completed|Failed|Crashed|Cancelled)\s*$"))
    state.first.wait_for()
    shot("flow-run-completed")
    assert state.first.inner_text().strip() == "Completed", (served.home / "serve.log").read_text()[-3000:]
    page.get_by_role("tab", name="Parameters").click()
    page.get_by_role("button", name="Copy parameters").wait_for()  # the JSON viewer renders lazily: check values by API
    shot("flow-run-parameters")

    with served.client() as client:
        flow_run = client.read_flow_run(flow_run_id)
    assert flow_run.parameters["spec"]["train"]["epochs"] == 3
    assert {"experiment:digits-mlp", "backend:local"} <= set(flow_run.tags)
    UI_RUN["flow_run"] = flow_run


def open_deployment(page, name: str) -> None:
    """Clicks the deployment's link in the list until its page opens: the list puts its sort and page into the URL
    after it first renders, and a click in that moment is lost (the page stays the list)."""
    link = page.locator("a[href*='/deployments/deployment/']", has_text=re.compile(rf"^{re.escape(name)}$"))
    for _ in range(3):
        link.click()
        try:
            page.wait_for_url(re.compile(r"/deployments/deployment/"), timeout=20_000)
            return
        except PlaywrightTimeout:
            continue
    raise AssertionError(f"the deployment list never opened {name!r}: still at {page.url}")


def runs_of(served, deployment_id) -> list:
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    with served.client() as client:
        return client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])))


def submit_until_a_run_exists(page, shot, new_runs, attempts: int = 3, wait_s: float = 90):
    """Clicks Submit and waits for the flow run it makes. On a busy machine a click can land while the form is still
    busy and do nothing, or the form can keep re-rendering under the click until the click times out: while the
    form is still there, click again."""
    submit = page.get_by_role("button", name="Submit")
    for attempt in range(1, attempts + 1):
        if submit.is_visible():  # still on the form (else the page moved on: the run is on its way)
            try:
                submit.click(timeout=30_000)
            except PlaywrightTimeout:  # it may have landed all the same: look before clicking again
                shot(f"submit-not-clickable-{attempt}")
                time.sleep(5)
                if not new_runs():
                    continue
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if runs := new_runs():
                return runs[0]
            time.sleep(1)
        shot(f"no-run-after-submit-{attempt}")
    raise AssertionError(f"the form made no flow run in {attempts * wait_s:.0f}s; see the screenshots")


def test_the_run_in_the_mlflow_ui(served, page):
    if "flow_run" not in UI_RUN:
        pytest.skip("needs the run started from the Prefect UI")
    page, shot = page
    client, run = mlflow_run_of(served.mlflow_url, UI_RUN["flow_run"].id, "digits-mlp")
    assert run.info.status == "FINISHED" and run.data.tags["prefect.deployment"] == "run-experiment"

    page.goto(f"{served.mlflow_url}/#/experiments")
    page.get_by_role("button", name="Model training").click()  # the default GenAI mode opens on traces
    page.get_by_role("link", name="digits-mlp", exact=True).click()
    shot("experiment-runs")
    page.get_by_role("link", name=run.info.run_name, exact=True).first.click()
    page.get_by_role("tab", name="Overview").first.wait_for()
    page.get_by_text(re.compile(r"Metrics \(\d+\)")).first.wait_for()
    shot("run-overview")
    # Its lineage: the Overview's Datasets section shows one ("+1" folds the other); clicked, it lists both.
    shown = {
        i.dataset.name: f"{i.dataset.name} ({i.dataset.digest})"
        for i in client.get_run(run.info.run_id).inputs.dataset_inputs
    }
    assert set(shown) == {"train", "validation"}
    page.get_by_text(re.compile("|".join(re.escape(text) for text in shown.values()))).first.click()
    for text in shown.values():
        page.get_by_text(text, exact=True).filter(visible=True).first.wait_for()
    shot("run-datasets")
    page.keyboard.press("Escape")  # the datasets' drawer closes
    page.get_by_role("dialog").wait_for(state="hidden")
    page.get_by_role("link", name="val_accuracy", exact=True).first.click()
    # "Model metrics" shows every metric's card (cost, timings too) and renders only those in view:
    # search for the one we want, as a person would.
    page.get_by_placeholder("Search metric charts").fill("val_accuracy")
    card = page.locator('[data-testid="experiment-view-compare-runs-card"]', has_text=re.compile(r"^\s*val_accuracy"))
    card.first.scroll_into_view_if_needed()
    chart = card.first.locator(".js-plotly-plot").first
    chart.wait_for()
    shot("val-accuracy-chart")
    points = chart.evaluate("plot => plot.data.map(trace => trace.x.length)")
    assert max(points) == 3, points  # one point per epoch

    version = client.search_model_versions(f"run_id = '{run.info.run_id}'")[0]
    page.goto(f"{served.mlflow_url}/#/experiments")
    page.get_by_role("link", name="Model registry").first.click()
    model = page.locator("a[href$='/models/digits-mlp']").first
    model.wait_for()
    with contextlib.suppress(PlaywrightTimeout):  # a first-visit modal about the new registry UI, shown late
        page.get_by_role("dialog").wait_for(timeout=10_000)
        page.get_by_role("dialog").get_by_role("button", name="Close").first.click()
        page.get_by_role("dialog").wait_for(state="hidden")
    shot("model-registry")
    model.click()
    page.get_by_role("link", name=f"Version {version.version}", exact=True).first.click()
    source_run = page.get_by_role("link", name=re.compile(run.info.run_name)).first
    source_run.wait_for()
    shot("registered-model-version")
    assert run.info.run_id in (source_run.get_attribute("href") or "")


def test_the_mlflow_run_links_back_to_the_prefect_run(served, page):
    if "flow_run" not in UI_RUN:
        pytest.skip("needs the run started from the Prefect UI")
    page, shot = page
    flow_run = UI_RUN["flow_run"]
    _, run = mlflow_run_of(served.mlflow_url, flow_run.id, "digits-mlp")
    url = run.data.tags["prefect.flow_run_url"]
    assert url.startswith(served.ui_url) and str(flow_run.id) in url
    page.goto(url)
    page.get_by_text(flow_run.name).first.wait_for()
    shot("prefect-run-from-mlflow-tag")

"""Headless Chromium (Debian's /usr/bin/chromium) driven by Playwright, offline: every non-loopback request is blocked.

apt-get install -y chromium && .venv/bin/python -m pytest --full -m browser
"""

import shutil
import tempfile
from pathlib import Path

import pytest

from tests.support.repo import REPO
from tests.support.tiers import require

CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOTS = REPO / "test-artifacts" / "ui"
# MLflow's UI opens an assistant side panel on a fresh profile's first visit: mark it seen and closed.
MLFLOW_FIRST_VISIT = """
try {
  localStorage.setItem('mlflow.assistant.fab.autoOpenedOnFirstLoad_v1', 'true');
  localStorage.setItem('mlflow.assistant.panelOpen_v1', 'false');
} catch (e) {}
"""


@pytest.fixture(scope="session")
def browser():
    """A Chromium context with a fresh profile; yields (context, list of blocked outside requests)."""
    require(CHROMIUM.exists(), "Chromium (/usr/bin/chromium)", "apt-get install -y chromium")
    try:
        from playwright import sync_api
    except ImportError:
        require(False, "Playwright", "pip install -e '.[dev]'")
    profile = tempfile.mkdtemp(prefix="gpuflow-chromium-")
    blocked: list[str] = []

    def only_loopback(route):
        url = route.request.url
        if url.startswith(("http://127.0.0.1", "http://localhost", "data:", "blob:", "about:")):
            route.continue_()
        else:
            blocked.append(url)  # e.g. the Prefect UI's analytics host: offline by design
            route.abort()

    with sync_api.sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            profile,
            executable_path=str(CHROMIUM),
            headless=True,
            viewport={"width": 1400, "height": 1000},
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--disable-dev-shm-usage",
            ],
        )
        try:
            context.set_default_timeout(60_000)
            context.add_init_script(MLFLOW_FIRST_VISIT)
            context.route("**/*", only_loopback)
            yield context, blocked
        finally:
            context.close()
            shutil.rmtree(profile, ignore_errors=True)


class Screenshots:
    """Numbered screenshots of one test under test-artifacts/ui/<test>/, kept on success and on failure."""

    def __init__(self, page, folder: Path):
        self.page, self.folder, self.count = page, folder, 0
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)

    def __call__(self, step: str) -> Path:
        self.count += 1
        path = self.folder / f"{self.count:02d}-{step}.png"
        self.page.screenshot(path=str(path), full_page=False)
        return path


@pytest.fixture
def page(browser, request):
    context, _ = browser
    page = context.new_page()
    shots = Screenshots(page, SCREENSHOTS / request.node.name)
    try:
        yield page, shots
    finally:
        try:
            shots("last")  # where the page was when the test ended, failed or not
        finally:
            page.close()

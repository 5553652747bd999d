"""The report as people see it: the flow run's artifact page in Prefect's own UI, in headless Chromium.

A local Prefect server serves its UI from the wheel (nothing online); the flow runs against it as a process of its
own, and Debian's Chromium, driven by Selenium through Debian's chromedriver, opens the artifact in both UIs the
server ships (v2, the default, and v1). Set UPDATE_SCREENSHOTS=1 to rewrite docs/report-ui.png, which
docs/how-to/prefect.md shows, from this run; otherwise the screenshot goes to the test's tmp_path.
"""

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

from pipeline import report
from pipeline.stages import STAGES

REPO = Path(__file__).resolve().parents[2]
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
SCREENSHOT = REPO / "docs/report-ui.png"
ALT = "loss and accuracy"

pytestmark = [
    # About 50 s on 2 cores (a server, its UI, Chromium): outside the quick suite, whose budget is 10 minutes; the
    # report's content is also checked without a browser (tests/flows/test_train_to_deploy.py).
    pytest.mark.slow,
    pytest.mark.skipif(
        not (CHROMIUM and CHROMEDRIVER),
        reason="headless Chromium not installed (Debian: apt-get install chromium chromium-driver; "
        "`make test` installs them when run as root)",
    ),
    pytest.mark.skipif(find_spec("selenium") is None, reason="selenium not installed (pip install -e '.[dev]')"),
]


def _api(env: dict[str, str], path: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(
        f"{env['PREFECT_API_URL']}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as resp:
        return json.load(resp)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    """Debian's Chromium, headless, 1000 px wide, through Debian's chromedriver: Selenium Manager (which would
    download a driver) is never asked, because the driver's path is given."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root, where Chromium's sandbox will not start
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--hide-scrollbars",
        "--window-size=1000,900",
        "--no-first-run",
        "--disable-background-networking",
        f"--user-data-dir={tmp_path / 'chromium'}",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _open_artifact(browser: Any, url: str) -> dict[str, Any]:
    """Open an artifact page and wait until its report image has loaded or failed; what the page holds."""
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(url)
    WebDriverWait(browser, 60).until(
        lambda d: d.execute_script(
            "const img = document.querySelector(`img[alt='${arguments[0]}']`);"
            "return img !== null && img.complete && document.querySelectorAll('table').length > 0;",
            ALT,
        ),
        f"no '{ALT}' image and table on {url}",
    )
    return browser.execute_script(
        """
        const cells = row => Array.from(row.cells, c => c.innerText.trim());
        return {
          // Elements without a src (CodeMirror's spacers in the raw view) are not images anyone sees.
          images: Array.from(document.querySelectorAll('img[src]'),
                             i => ({alt: i.alt, src: i.src.slice(0, 40), width: i.naturalWidth})),
          tables: Array.from(document.querySelectorAll('table'), t => Array.from(t.rows, cells)),
          overflow: document.documentElement.scrollWidth - document.documentElement.clientWidth,
          text: document.body.innerText,
        };
        """
    )


def _screenshot(browser: Any, path: Path) -> None:
    """The page down to the bottom of the curves, 1000 px wide, as a small palette PNG."""
    from PIL import Image

    # Size the viewport to end just below the curves. The window is taller than its viewport (headless Chromium
    # keeps room for its toolbars), and the page may still move (the artifact's description loads on its own):
    # repeat until the viewport fits.
    for _ in range(10):
        bottom, inner, outer = browser.execute_script(
            f"const img = document.querySelector(\"img[alt='{ALT}']\");"
            "return [img.getBoundingClientRect().bottom + window.scrollY, window.innerHeight, window.outerHeight];"
        )
        if inner == int(bottom) + 32:
            break
        browser.set_window_size(1000, outer - inner + int(bottom) + 32)
        time.sleep(0.5)
    browser.execute_script("window.scrollTo(0, 0)")
    path.parent.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(path))
    # 128 colours keep the text and curves sharp at a fraction of the size of a full-colour screenshot.
    Image.open(path).convert("RGB").quantize(128).save(path, optimize=True)


def test_report_artifact_renders_in_the_prefect_ui(prefect_ui: dict[str, str], browser: Any, tmp_path: Path):
    runs = tmp_path / "runs"
    overrides = [
        "train.epochs=2",
        "train.nproc_per_node=1",
        f"run.runs_root={runs}",
        f'deploy.targets=[{{name="edge", root="{tmp_path / "device"}"}}]',
    ]
    cmd = [sys.executable, "-m", "flows.train_to_deploy", *(arg for o in overrides for arg in ("--set", o))]
    flow = subprocess.run(cmd, env=prefect_ui, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert flow.returncode == 0, flow.stdout[-3000:] + flow.stderr[-3000:]

    (flow_run,) = _api(prefect_ui, "/flow_runs/filter", {})
    assert flow_run["state_type"] == "COMPLETED"
    query = {"artifacts": {"key": {"any_": ["train-to-deploy-report"]}, "flow_run_id": {"any_": [flow_run["id"]]}}}
    (artifact,) = _api(prefect_ui, "/artifacts/filter", query)
    (run_dir,) = runs.iterdir()
    stages = json.loads((run_dir / "manifest.json").read_text())["stages"]

    ui = prefect_ui["PREFECT_UI_URL"]
    v2, v1 = f"{ui}/v2/artifacts/artifact/{artifact['id']}", f"{ui}/artifacts/artifact/{artifact['id']}"
    for url in (v1, v2):  # v2, the default UI, last: the screenshot is of it
        page = _open_artifact(browser, url)
        assert [i for i in page["images"] if i["width"] == 0] == [], f"images that did not load on {url}"
        assert any(i["alt"] == ALT and i["src"].startswith("data:image/png;base64,") for i in page["images"])

        stage_table = next(t for t in page["tables"] if t[0] == ["stage", "status", "seconds", "result"])
        assert [row[0] for row in stage_table[1:]] == list(STAGES), f"stage table broken on {url}"
        assert all(len(row[3]) <= report.SHORT_REASON + 1 for row in stage_table[1:])
        assert any(t[0] == ["epoch", "train_loss", "val_loss", "val_accuracy"] for t in page["tables"])
        assert any(t[0][:2] == ["max_abs_diff", "atol"] for t in page["tables"])  # the parity gate
        assert page["overflow"] <= 0, f"the page scrolls sideways on {url}"
        if stages["build"]["status"] == "skipped":  # no TensorRT here: the long reason, shortened, then in full
            build = next(row for row in stage_table if row[0] == "build")
            assert build[3] == report.short_reason(stages["build"]["reason"]).replace("`", "")
            assert " ".join(stages["build"]["reason"].split()).replace("`", "") in " ".join(page["text"].split())

    shot = SCREENSHOT if os.environ.get("UPDATE_SCREENSHOTS") == "1" else tmp_path / "report-ui.png"
    _screenshot(browser, shot)
    assert 0 < shot.stat().st_size < 400_000

"""The docs site (mkdocs.yml, docs/hooks/): the strict build passes, a broken link fails it, the generated reference
covers every config key and every command, and the built pages open in headless Chromium.

One build for the module (about 2 s once the pipeline is imported), in process, with the repository's mkdocs.yml as it
is except for the output folder.
"""

from __future__ import annotations

import logging
import re
import shutil
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest
import typer
from mkdocs.commands.build import build
from mkdocs.config import load_config
from mkdocs.exceptions import Abort, PluginError
from pydantic import BaseModel, Field

import benchmark_tables
import generate
import reference
from pipeline.cli import app
from pipeline.config import Config, Section, TrainConfig

REPO = Path(__file__).resolve().parents[2]
CONFIG_FILE = REPO / "mkdocs.yml"
SCREENSHOT = REPO / "artifacts" / "docs-tutorial.png"
"""Where the tutorial's screenshot goes (artifacts/ is git-ignored; the closing note of issue #30 shows it)."""
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
REMOTE = re.compile(r"<(?:script|link|img)\b[^>]*\b(?:src|href)=\"(?:https?:)?//[^\"]*\"")
"""A script, stylesheet, font or image the browser would fetch from the network."""


def build_site(site_dir: Path, **overrides: Any) -> None:
    """`mkdocs build` of the repository's mkdocs.yml into `site_dir`, with `overrides` of its settings."""
    config = load_config(str(CONFIG_FILE), site_dir=str(site_dir), **overrides)
    assert config.strict, "mkdocs.yml must build with strict: true"
    build(config)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The whole site, built once, strict."""
    site_dir = tmp_path_factory.mktemp("site")
    build_site(site_dir)
    return site_dir


def config_keys(model: type[BaseModel], prefix: str) -> Iterator[str]:
    """Every key of `model` as the config reference writes it: dotted, `[]` for an array of tables."""
    for name, field in model.model_fields.items():
        yield f"{prefix}.{name}"
        item = reference.nested(field.annotation)
        if item is not None:
            yield from config_keys(item, f"{prefix}.{name}[]")


def test_the_strict_build_writes_every_page_with_its_generated_parts(site: Path) -> None:
    for page in ("index", "tutorial", "reference/config", "reference/cli", "benchmarks", "how-to/cluster"):
        assert (site / f"{page}.html").is_file(), page
    for html in site.rglob("*.html"):
        assert "<!-- generated:" not in html.read_text(), f"{html}: a marker was left unexpanded"
    assert (site / "benchmarks/results/train_compression.png").is_file(), "the plots are copied beside the pages"
    loads = [m[0] for html in site.rglob("*.html") for m in REMOTE.finditer(html.read_text())]
    assert not loads, f"pages load from the network (fonts?): {loads[:3]}"


def test_a_broken_link_fails_the_strict_build(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    docs = tmp_path / "docs"
    shutil.copytree(REPO / "docs", docs, ignore=shutil.ignore_patterns("hooks", "__pycache__"))
    with (docs / "tutorial.md").open("a") as page:
        page.write("\nSee [the missing page](no-such-page.md).\n")
    with caplog.at_level(logging.WARNING, logger="mkdocs"), pytest.raises(Abort, match="1 warnings in strict mode"):
        build_site(tmp_path / "site", docs_dir=str(docs))
    assert "no-such-page.md" in caplog.text


def test_an_unknown_generated_block_stops_the_build() -> None:
    with pytest.raises(PluginError, match="unknown generated block 'no-such-table'"):
        generate.expand("# A page\n\n<!-- generated: no-such-table -->\n", "page.md")


def test_every_config_key_is_in_the_config_reference(site: Path) -> None:
    html = (site / "reference/config.html").read_text()
    keys = [key for name, section in Config.model_fields.items() for key in config_keys(section.annotation, name)]
    missing = [key for key in keys if f"<code>{key}</code>" not in html]
    assert not missing, f"not in the config reference: {missing}"
    assert len(keys) > 80


def test_every_command_and_option_is_in_the_cli_reference(site: Path) -> None:
    html = (site / "reference/cli.html").read_text()
    root = typer.main.get_command(app)
    seen = 0
    for command, ctx in reference.commands(root, root.context_class(root, info_name="pipeline")):
        assert f"<code>{ctx.command_path}</code>" in html, ctx.command_path
        for param in command.params:
            for opt in param.opts:
                assert opt in html, f"{ctx.command_path} {opt}"
        seen += 1
    assert seen >= 15  # 8 commands and groups at the top, 7 under deploy, cluster and runs


class Lr(Section):
    lr: float = 0.1
    """The step size."""


class LrChanged(Section):
    lr: float = 0.1
    """The step size, halved after every epoch."""


class Before(Section):
    train: Lr = Field(default_factory=Lr)


class After(Section):
    train: LrChanged = Field(default_factory=LrChanged)


def test_a_field_docstring_is_the_config_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """A docstring is all there is to edit: pydantic makes it the description, the page shows the description."""
    row = "| `train.lr` | float | `0.1` | {} |"
    assert row.format("The step size.") in reference.config_reference(Before)
    assert row.format("The step size, halved after every epoch.") in reference.config_reference(After)
    page = reference.config_reference()
    monkeypatch.setattr(TrainConfig.model_fields["weight_decay"], "description", "Decay, said anew.")
    changed = reference.config_reference()
    assert "Decay, said anew." in changed and "Decay, said anew." not in page


def test_bounds_and_choices_come_from_the_annotations() -> None:
    page = reference.config_reference()
    assert "| `data.image_size` | integer ≥ 8, ≤ 1024 | `16` |" in page
    assert '| `train.epochs` | integer ≥ 1, ≤ 100000 or `"auto"` | `"auto"` |' in page
    assert "matching `^\\d+\\.\\d+$`" in page  # export.min_tensorrt's pattern
    assert "| `build.classes[].name` | string matching `^[A-Za-z0-9][A-Za-z0-9._-]*$` | required |" in page


def test_a_benchmark_table_shows_the_file_s_numbers() -> None:
    held = {"params_mb": 1.25, "grads_mb": 2.0, "optimizer_mb": 4.0, "peak_rss_mb": 999.94}
    data = {"ddp": held, "fsdp": held}
    assert "| DDP | 1.2 | 2.0 | 4.0 | 999.9 |" in benchmark_tables.train_memory(data)
    assert set(benchmark_tables.TABLES) <= {p.stem for p in benchmark_tables.RESULTS.glob("*.json")}


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    """Debian's Chromium, headless, through Debian's chromedriver (as tests/flows/test_report_ui.py drives it)."""
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("headless Chromium not installed (Debian: apt-get install chromium chromium-driver)")
    if find_spec("selenium") is None:
        pytest.skip("selenium not installed (pip install -e '.[dev]')")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--hide-scrollbars"):
        options.add_argument(arg)
    options.add_argument("--window-size=1400,1000")  # wide enough for the navigation and the table of contents
    options.add_argument(f"--user-data-dir={tmp_path / 'chromium'}")
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def test_the_pages_open_from_disk_in_chromium(site: Path, browser: Any) -> None:
    """file:// pages, no server: the home page's title and the config reference's sections are there, and the
    tutorial's screenshot is saved for the issue's closing note."""
    from selenium.webdriver.common.by import By

    home_title = (REPO / "docs/index.md").read_text().splitlines()[0].removeprefix("# ")
    browser.get((site / "index.html").as_uri())
    assert browser.find_element(By.TAG_NAME, "h1").text.strip() == home_title
    browser.get((site / "reference/config.html").as_uri())
    headings = [h.text for h in browser.find_elements(By.CSS_SELECTOR, "article h2")]
    assert [f"[{name}]" for name in Config.model_fields] == [h.removesuffix("¶").strip() for h in headings]
    browser.get((site / "tutorial.html").as_uri())
    assert browser.find_element(By.TAG_NAME, "h1").text.strip()
    SCREENSHOT.parent.mkdir(exist_ok=True)
    browser.save_screenshot(str(SCREENSHOT))
    assert SCREENSHOT.stat().st_size > 10_000

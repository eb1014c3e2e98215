"""report.html (``evalkit-report RESULTS --html``): one self-contained page, and, in headless Chromium, its plots
render, its tables sort by a click on a header and each run links to its config and samples.

The browser test needs Debian's chromium and chromium-driver and selenium (tests/browser/install_chromium.sh); it
saves a screenshot to its tmp dir and, where EVALKIT_SCREENSHOT_DIR is set, there too."""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from evalkit.results import metrics_table, samples_table, write_table
from evalkit.results.html_page import write_page
from evalkit.results.report import write_report

# (method, budget) -> documents answered of 20; the full cache answers 18
CORRECT = {("full", None): 18, ("snapkv", "2x"): 18, ("snapkv", "4x"): 16, ("snapkv", "8x"): 12,
           ("streaming_llm", "2x"): 14, ("streaming_llm", "4x"): 8, ("streaming_llm", "8x"): 4}
FACTOR = {None: 1.0, "2x": 2.0, "4x": 4.0, "8x": 8.0}


@pytest.fixture
def results_dir(tmp_path):
    """Seven runs of one task, 20 samples each, with their measured KV bytes and decode speed."""
    results = tmp_path / "results"
    for index, ((method, budget), correct) in enumerate(CORRECT.items()):
        run_id = f"run{index}-{method}-{budget or 'full'}"
        config = {"run_id": run_id, "model": "tiny", "task": "kv_retrieval", "method": method, "budget": budget,
                  "seed": 1234, "limit": 20, "compression_scope": "prompt"}
        samples = [{"doc_id": doc, "sample_id": f"kv-{doc:03d}", "subset": "depth_early" if doc % 2 else "depth_late",
                    "repeat": 0, "prediction": f"v{doc} u{doc + (0 if doc < correct else 1)}",
                    "target": f"v{doc} u{doc}", "score": float(doc < correct), "prompt_tokens": 200,
                    "compression_ratio": 1 - 1 / FACTOR[budget]} for doc in range(20)]
        metrics = [{"subset": "all", "metric": "exact_match", "value": correct / 20, "stderr": 0.05, "n": 20},
                   {"subset": "all", "metric": "kv_bytes_peak_mean", "value": 2**26 / FACTOR[budget], "n": 20},
                   {"subset": "all", "metric": "decode_tokens_per_s", "value": 100 * FACTOR[budget] ** 0.5, "n": 20}]
        write_table(samples_table(samples, config), results, "samples", run_id)
        write_table(metrics_table(metrics, config), results, "metrics", run_id)
    return results


def written_page(results_dir) -> tuple[Path, dict]:
    paths = write_report(results_dir, iterations=200)
    return write_page(results_dir, paths), paths


def test_the_page_is_one_file_with_its_plots_inline_and_a_section_per_run(results_dir):
    page, paths = written_page(results_dir)
    text = page.read_text()
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", text)  # nothing fetched from anywhere
    images = re.findall(r'<img alt="[^"]*" src="data:image/png;base64,([^"]+)"', text)
    assert len(images) == len([p for p in paths.values() if p.suffix == ".png"]) >= 3
    assert all(base64.b64decode(image)[:4] == b"\x89PNG" for image in images)
    for index, ((method, budget), _) in enumerate(CORRECT.items()):
        anchor = f"run-run{index}-{method}-{budget or 'full'}"
        assert f'href="#{anchor}"' in text and f'id="{anchor}"' in text
        csv = re.search(rf'<section class="run" id="{anchor}">.*?href="([^"]+samples/[^"]+\.csv)"', text).group(1)
        assert (page.parent / csv).resolve() == (results_dir / "csv" / "samples" / f"{anchor[4:]}.csv").resolve()
    assert text.count("<tr>") == (1 + 3) + (1 + 7) + 7 * (1 + 20)  # header and rows: pivot, runs, each run's samples


def test_the_report_command_writes_the_page_with_html(results_dir):
    result = subprocess.run([sys.executable, "-m", "evalkit.results.report", str(results_dir), "--html",
                             "--bootstrap", "100"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (results_dir / "report" / "report.html").stat().st_size > 50_000
    written = result.stdout.splitlines()[-1]
    assert written.startswith(f"written to {results_dir / 'report'}/: ") and ", report.html " in written


def _browser():
    """Headless Chromium driven by selenium; skips with the reason where either is missing."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed: "
                                    "tests/browser/install_chromium.sh")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("chromium and chromium-driver are not installed: tests/browser/install_chromium.sh")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1400,1800"):
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver))


@pytest.mark.slow
def test_the_page_renders_and_sorts_in_headless_chromium(results_dir, tmp_path):
    from selenium.webdriver.common.by import By

    page, _ = written_page(results_dir)
    browser = _browser()
    try:
        browser.get(page.as_uri())
        images = browser.find_elements(By.TAG_NAME, "img")
        assert len(images) >= 3
        assert all(browser.execute_script("return arguments[0].complete && arguments[0].naturalWidth", image) > 300
                   for image in images)
        rows = browser.find_elements(By.CSS_SELECTOR, "#runs-table tbody tr")
        assert len(rows) == 7 and all(row.is_displayed() for row in rows)
        assert len(browser.find_elements(By.CSS_SELECTOR, "#pivot-table tbody tr")) == 3  # full, snapkv, streaming_llm

        def column(name):
            headers = [th.text.strip() for th in browser.find_elements(By.CSS_SELECTOR, "#runs-table thead th")]
            position = headers.index(name) + 1
            return [cell.text for cell in browser.find_elements(
                By.CSS_SELECTOR, f"#runs-table tbody tr td:nth-child({position})")]

        header = next(th for th in browser.find_elements(By.CSS_SELECTOR, "#runs-table thead th")
                      if th.text.strip() == "value")
        assert column("value") != sorted(column("value"), key=float)  # grouped by method: not yet by value
        header.click()
        assert [float(v) for v in column("value")] == sorted(c / 20 for c in CORRECT.values())
        assert header.get_attribute("aria-sort") == "ascending"
        header.click()
        assert [float(v) for v in column("value")] == sorted((c / 20 for c in CORRECT.values()), reverse=True)
        assert column("method")[0] in ("full", "snapkv")  # rows move whole: 0.9 belongs to these two
        budget = next(th for th in browser.find_elements(By.CSS_SELECTOR, "#runs-table thead th")
                      if th.text.strip() == "budget")
        budget.click()  # by compression, the full cache first, not alphabetically (2x, 4x, 8x, full)
        assert column("budget")[0] == "full" and column("budget")[-1] == "8x"
        link = browser.find_element(By.CSS_SELECTOR, "#runs-table tbody tr td a")
        target = link.get_attribute("href").split("#")[1]
        link.click()
        assert browser.execute_script("return location.hash") == f"#{target}"
        section = browser.find_element(By.ID, target)
        section.find_element(By.TAG_NAME, "summary").click()  # open its samples
        samples = section.find_elements(By.CSS_SELECTOR, "details tbody tr")
        assert len(samples) == 20 and samples[0].is_displayed()
        assert "kv_retrieval" in section.find_element(By.CSS_SELECTOR, "dl.config").text
        shots = [tmp_path / "report_html_run.png", tmp_path / "report_html.png"]
        browser.save_screenshot(str(shots[0]))  # the run's section, its samples open
        browser.execute_script("window.scrollTo(0, 0)")
        browser.save_screenshot(str(shots[1]))
    finally:
        browser.quit()
    assert all(shot.read_bytes()[:4] == b"\x89PNG" for shot in shots)
    if os.environ.get("EVALKIT_SCREENSHOT_DIR"):
        Path(os.environ["EVALKIT_SCREENSHOT_DIR"]).mkdir(parents=True, exist_ok=True)
        for shot in shots:
            shutil.copy(shot, Path(os.environ["EVALKIT_SCREENSHOT_DIR"]) / shot.name)

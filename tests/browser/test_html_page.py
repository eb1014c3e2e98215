"""report.html (``evalkit-report RESULTS --html``): one self-contained page, and, in headless Chromium, its plots
render, its tables sort by a click on a header, each run links to its config and samples, and the primary metric's
columns are on the first screen at 1,400 and 3,000 px wide (what every run shares said once above them).

The browser test needs Debian's chromium and chromium-driver and selenium (tests/browser/install_chromium.sh); it
saves a screenshot to its tmp dir and, where EVALKIT_SCREENSHOT_DIR is set, there too."""

from __future__ import annotations

import base64
import json
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
    # header and rows: pivot, runs, the runs' every column, the paired tests of the 6 compressed runs, the ties of the
    # three budgets (two configurations each), each run's samples
    assert text.count("<tr>") == (1 + 3) + (1 + 7) + (1 + 7) + (1 + 6) + (1 + 6) + 7 * (1 + 20)


def test_the_report_command_writes_the_page_with_html(results_dir):
    result = subprocess.run([sys.executable, "-m", "evalkit.results.cli", str(results_dir), "--html",
                             "--bootstrap", "100"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (results_dir / "report" / "report.html").stat().st_size > 50_000
    written = result.stdout.splitlines()[-1]
    assert written.startswith(f"written to {results_dir / 'report'}/: ") and ", report.html " in written


def _browser(width: int = 1400, height: int = 1800):
    """Headless Chromium driven by selenium, its window ``width`` x ``height``; skips with the reason where either is
    missing."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed: "
                                    "tests/browser/install_chromium.sh")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("chromium and chromium-driver are not installed: tests/browser/install_chromium.sh")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 f"--window-size={width},{height}"):
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
                      if th.text.strip() == "exact_match")  # the score, named after the metric every run shares
        assert column("exact_match") != sorted(column("exact_match"), key=float)  # grouped by method: not yet by value
        header.click()
        assert [float(v) for v in column("exact_match")] == sorted(c / 20 for c in CORRECT.values())
        assert header.get_attribute("aria-sort") == "ascending"
        header.click()
        assert [float(v) for v in column("exact_match")] == sorted((c / 20 for c in CORRECT.values()), reverse=True)
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


# Two models on one task, as a results folder gathers them: each model's own source fingerprint, path, chat template
# and context, the data's fingerprint and the task's shared by all, each policy's fields as JSON.
MODELS = {"kv_retrieval_tiny": ("builtin:kv_retrieval_tiny", "local:sha256:" + "0b08988ca69ec3d9" * 2, False, 256),
          "smollm2_135m_instruct": ("/root/.cache/evalkit/models/smollm2-135m-instruct-f16",
                                    "local:sha256:" + "5f1e0c7a9d2b4e68" * 2, True, 2048)}
PAIRS = {"kv_retrieval_tiny": [("full", None), ("snapkv", "2x"), ("snapkv", "4x"), ("snapkv", "8x"),
                               ("streaming_llm", "2x"), ("streaming_llm", "4x"), ("streaming_llm", "8x")],
         "smollm2_135m_instruct": [("full", None), ("snapkv", "2x"), ("snapkv", "4x"), ("snapkv", "8x")]}


@pytest.fixture
def two_models(tmp_path):
    results = tmp_path / "results"
    for model, pairs in PAIRS.items():
        pretrained, source, chat, context = MODELS[model]
        for index, (method, budget) in enumerate(pairs):
            run_id = f"{model}-{method}-{budget or 'full'}"
            capacity = context // int(budget[:-1]) if budget else None
            window = (capacity - 4 if method == "streaming_llm" else 32) if budget else None
            config = {"run_id": run_id, "model": model, "model_pretrained": pretrained, "model_source": source,
                      "apply_chat_template": chat, "max_context": context, "task": "kv_retrieval",
                      "task_options": "{}", "method": method, "budget": budget, "capacity": capacity,
                      "window": window, "policy_params": json.dumps({"capacity": capacity, "window": window}),
                      "seed": 1234, "limit": 20, "compression_scope": "prompt",
                      "dataset_source": "local:sha256:" + "df017fcda5e5988e" * 2,
                      "task_definition": "sha256:" + "1f43f883db94a695" * 2}
            correct = 18 - 2 * index
            samples = [{"doc_id": doc, "sample_id": f"kv-{doc:03d}", "repeat": 0, "score": float(doc < correct)}
                       for doc in range(20)]
            metrics = [{"subset": "all", "metric": "exact_match", "value": correct / 20, "stderr": 0.05, "n": 20},
                       {"subset": "all", "metric": "memory_ratio_mean", "value": FACTOR[budget], "n": 20}]
            write_table(samples_table(samples, config), results, "samples", run_id)
            write_table(metrics_table(metrics, config), results, "metrics", run_id)
    return results


def test_what_every_run_shares_is_said_once_above_the_tables(two_models):
    page, _ = written_page(two_models)
    text = page.read_text()
    top, tables = text.split('<table id="pivot-table"', 1)
    shared = re.search(r'<p class="shared" id="shared">(.*?)</p>', top).group(1)
    assert "task <code>kv_retrieval</code>" in shared and "seed <code>1234</code>" in shared
    assert "limit <code>20</code>" in shared and "df017fcda5e5988e" not in shared  # a fingerprint: one click away
    assert re.search(r"<details><summary>Every setting the runs share.*?df017fcda5e5988e", top, flags=re.S)
    first_tables = tables.split('<details id="every-column">', 1)[0]
    for said_once in (">kv_retrieval<", ">1234<", "df017fcda5e5988e", "0b08988ca69ec3d9", "{&quot;capacity"):
        assert said_once not in first_tables, said_once


@pytest.mark.parametrize("width,height", [(1400, 900), (3000, 1200)])
def test_the_primary_metric_is_on_the_first_screen(two_models, tmp_path, width, height):
    """At 1,400 and 3,000 px wide, before any scrolling: the first table's columns are the method, what sets runs
    apart and the primary metric by budget, all of them inside the window and their box, rows one line tall; the
    runs table's score column is in view across (settings the same for a model's every run are not columns)."""
    from selenium.webdriver.common.by import By

    page, _ = written_page(two_models)
    browser = _browser(width, height)
    try:
        browser.get(page.as_uri())
        view = browser.execute_script("return {w: document.documentElement.clientWidth, h: innerHeight}")

        def seen(element) -> bool:
            """Inside the first viewport and not clipped by the scrolling box around its table."""
            return browser.execute_script("""
                const r = arguments[0].getBoundingClientRect(), box = arguments[0].closest('.scroll')
                  .getBoundingClientRect();
                return r.width > 0 && r.left >= Math.max(0, box.left) && r.right <= Math.min(arguments[1], box.right)
                  && r.top >= 0 && r.bottom <= arguments[2];""", element, view["w"], view["h"])

        first = browser.find_elements(By.TAG_NAME, "table")[0]
        assert first.get_attribute("id") == "pivot-table"
        assert "exact_match" in browser.find_element(By.ID, "pivot").text  # the heading names the metric
        headers = [th.text.strip() for th in first.find_elements(By.CSS_SELECTOR, "thead th")]
        assert headers == ["model", "method", "full cache", "budget 2x", "budget 4x", "budget 8x"]
        cells = first.find_elements(By.CSS_SELECTOR, "thead th, tbody td")
        assert all(seen(cell) for cell in cells), [c.text for c in cells if not seen(c)]
        rows = first.find_elements(By.CSS_SELECTOR, "tbody tr")
        assert len(rows) == 5 and all(row.rect["height"] < 40 for row in rows)  # full, snapkv x 2, streaming_llm
        runs = browser.find_element(By.ID, "runs-table")
        headers = [th.text.strip() for th in runs.find_elements(By.CSS_SELECTOR, "thead th")]
        assert headers[:4] == ["#", "model", "method", "budget"] and "exact_match" in headers
        assert not {"task", "model_pretrained", "model_source", "apply_chat_template", "policy_params"} & set(headers)
        score = headers.index("exact_match") + 1
        column = runs.find_elements(By.CSS_SELECTOR, f"thead th:nth-child({score}), tbody td:nth-child({score})")
        assert browser.execute_script("""return arguments[0].every(cell => {
            const r = cell.getBoundingClientRect(), box = cell.closest('.scroll').getBoundingClientRect();
            return r.left >= Math.max(0, box.left) && r.right <= Math.min(arguments[1], box.right); })""",
                                      column, view["w"])
        assert all(row.rect["height"] < 40 for row in runs.find_elements(By.CSS_SELECTOR, "tbody tr"))
        browser.save_screenshot(str(tmp_path / f"report_html_{width}.png"))
    finally:
        browser.quit()
    if os.environ.get("EVALKIT_SCREENSHOT_DIR"):
        Path(os.environ["EVALKIT_SCREENSHOT_DIR"]).mkdir(parents=True, exist_ok=True)
        shutil.copy(tmp_path / f"report_html_{width}.png", Path(os.environ["EVALKIT_SCREENSHOT_DIR"]))

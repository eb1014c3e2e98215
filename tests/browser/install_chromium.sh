#!/usr/bin/env bash
# What the browser test of report.html (tests/browser/test_html_page.py, -m slow) needs on Debian: headless Chromium,
# its WebDriver, and selenium in the active environment. Run as root.
set -euo pipefail
apt-get update
apt-get install -y chromium chromium-driver
python -m pip install selenium

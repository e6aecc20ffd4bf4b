#!/usr/bin/env bash
# Regenerate docs/web-page.png, the README's picture of `headmoe serve`'s web page: the
# browser test (tests/serve/test_web_page.py) takes it after its two jobs and copies it here.
set -euo pipefail
cd "$(dirname "$0")/.."
HEADMOE_WEB_SCREENSHOT="$PWD/docs/web-page.png" .venv/bin/python -m pytest -q -p no:cacheprovider \
    "tests/serve/test_web_page.py::test_text_and_image_jobs_play_in_the_page"

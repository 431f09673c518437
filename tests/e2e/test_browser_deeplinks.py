"""Real browser: every page URL of a FRESH dashboard loads inside the one st.navigation (issue 12).

Each URL is the first request of its own freshly started dashboard (a bookmark opened before anyone visits /),
so nothing has run app.py before it: the ShardLab sidebar (written by app.py) and the st.navigation titles
must be there, and /new must not raise "Page not found"."""

from __future__ import annotations

import pytest

from tests.e2e.test_browser import CHROME_ARGS, CHROMIUM, _shot, dashboard  # noqa: F401 - the fixture is used by name

pytestmark = [pytest.mark.browser, pytest.mark.slow]

URLS = {"new": "New experiment", "runs": "Runs", "compare": "Compare", "formulas": "Formulas"}


@pytest.mark.parametrize("path", list(URLS))
def test_bookmarked_url_loads_inside_the_navigation(dashboard, path):  # noqa: F811 - pytest fixture
    from playwright.sync_api import expect, sync_playwright

    url, _, _ = dashboard
    expect.set_options(timeout=90_000)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROME_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1200})
        page.set_default_timeout(60_000)
        page.goto(f"{url}/{path}")  # the first request this dashboard ever serves
        sidebar = page.locator('[data-testid="stSidebar"]')
        expect(sidebar.get_by_text("ShardLab", exact=True)).to_be_visible()  # app.py ran
        nav = page.locator('[data-testid="stSidebarNav"]')
        for title in URLS.values():  # st.navigation's titles, not the legacy lower-case file names
            expect(nav.get_by_text(title, exact=True)).to_be_visible()
        expect(page.locator("h1").filter(has_text=URLS[path])).to_be_visible()
        assert page.get_by_text("Page not found").count() == 0
        assert page.url.rstrip("/").endswith(f"/{path}")
        _shot(page, f"deeplink_{path}")
        browser.close()

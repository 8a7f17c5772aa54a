"""The activity page at ``/activity`` in a real headless Chromium (Debian's ``chromium`` and
``chromium-driver``, driven by selenium): a pasted key stays in session storage, the page shows
the org's credits, draws the daily spend stacked by model from a seeded database, lists the
keys with their limits and the requests page by page, and downloads them as CSV; a screenshot
is kept (``TEST_ARTIFACTS_DIR``, else pytest's tmp dir).

Without Chromium this test fails, naming the packages: the page is part of what ships.
"""
import csv
import os
import shutil
import subprocess
import sys
import uuid
from datetime import datetime, time, timedelta, timezone
from decimal import Decimal
from pathlib import Path

import pytest
import requests
import sqlalchemy as sa

from gateway.api import auth
from gateway.models import usage_events
from gateway_proc import (Gateway, create_database, drop_database, gateway_env, make_org, migrate,
                          wait_until)

pytestmark = pytest.mark.postgres

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
KILN = str(Path(sys.executable).with_name("kiln"))
# (days ago, model, key, cost in nano-dollars)
SEED = [(2, "fake-model", "web", 1_500_000), (2, "fake-vision", "web", 500_000),
        (1, "fake-model", "ci", 250_000), (0, "fake-model", "web", 3_000_000),
        (0, "fake-vision", "ci", 1_000_000), (0, "fake-model", "ci", 2_000)]


@pytest.fixture(scope="module")
def seeded(catalog_path):
    """A scratch database with an org ($10 granted), two keys, and the usage of :data:`SEED`
    as the ledger leaves it: settled usage events, their daily rollup, each key's spend in its
    period and the balance less their cost (so ``kiln credits reconcile`` passes on it); a
    gateway on it: ``(gateway, org, ci_key, url)``."""
    name = f"kiln_page_{uuid.uuid4().hex[:10]}"
    url = create_database(name)
    migrate(url)
    engine = sa.create_engine(url)
    org = make_org(engine, "acme")
    with engine.begin() as conn:
        ci_key = auth.create_key(conn, org.id, name="ci-bot", limit_usd=Decimal("0.01"),
                                 limit_reset="monthly", rpm_limit=30)
        _seed(conn, org.id)
    gw = Gateway(gateway_env(url, catalog_path), workers=1).start()
    yield gw, org, ci_key, url
    gw.stop()
    engine.dispose()
    drop_database(name)


# The rollup and the keys' spend from the events, as settlement leaves them (and as migration
# 0003 backfills them).
ROLLUP = """INSERT INTO usage_daily (org_id, day, model, api_key_id, requests, errors,
    prompt_tokens, cached_tokens, completion_tokens, cost_nanos)
  SELECT org_id, CAST(started_at AT TIME ZONE 'UTC' AS date), model, api_key_id, count(*),
         count(*) FILTER (WHERE status <> 'completed'), sum(prompt_tokens), sum(cached_tokens),
         sum(completion_tokens), sum(cost_nanos)
    FROM usage_events WHERE org_id = :o GROUP BY 1, 2, 3, 4"""
KEY_SPEND = """UPDATE api_keys k
   SET period_start = kiln_period_start(k.limit_reset, now()),
       period_spent_nanos = (SELECT COALESCE(sum(e.cost_nanos), 0) FROM usage_events e
                              WHERE e.api_key_id = k.id AND e.status <> 'pending'
                                AND (kiln_period_start(k.limit_reset, now()) IS NULL
                                     OR e.ended_at >= kiln_period_start(k.limit_reset, now())))
 WHERE k.org_id = :o"""


def _seed(conn, org_id):
    """Three settled events per :data:`SEED` row (its cost split among them), a second after
    the UTC midnight that starts their day."""
    keys = dict(conn.execute(sa.text("SELECT name, id FROM api_keys WHERE org_id = :o"),
                             {"o": org_id}).all())
    keys = {"web": keys["test"], "ci": keys["ci-bot"]}
    today = datetime.now(timezone.utc).date()
    for age, model, key, cost in SEED:
        at = datetime.combine(today - timedelta(days=age), time(0, 0, 1), timezone.utc)
        for part in (cost // 3, cost // 3, cost - 2 * (cost // 3)):
            conn.execute(usage_events.insert().values(
                id=f"gen-{uuid.uuid4().hex[:24]}", org_id=org_id, api_key_id=keys[key],
                model=model, stream=False, status="completed", prompt_tokens=4,
                cached_tokens=1, completion_tokens=2, cost_nanos=part, http_status=200,
                started_at=at, ended_at=at))
    conn.execute(sa.text(ROLLUP), {"o": org_id})
    conn.execute(sa.text(KEY_SPEND), {"o": org_id})
    conn.execute(sa.text("UPDATE credit_balances SET balance_nanos = balance_nanos - :c "
                         "WHERE org_id = :o"), {"c": sum(s[3] for s in SEED), "o": org_id})


def spent(key, today, since=None):
    """What ``key`` (``web`` or ``ci``) spent on the seeded days from ``since`` on (all of them
    without ``since``), in nano-dollars."""
    return sum(cost for age, _m, k, cost in SEED
               if k == key and (since is None or today - timedelta(days=age) >= since))


def page_usd(nanos):
    """Dollars as the page writes them: the sign, exact, at least two decimal places."""
    whole, _, fraction = format(Decimal(nanos).scaleb(-9), "f").partition(".")
    return f"${whole}.{fraction.rstrip('0').ljust(2, '0')}"


@pytest.fixture(scope="module")
def browser():
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not shutil.which(p)]
    if missing:
        pytest.fail(f"{' and '.join(missing)} missing: install the Debian packages chromium "
                    f"and chromium-driver (.ci/run does)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     "--disable-gpu", "--window-size=1100,1300"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_script_timeout(30)
    yield driver
    driver.quit()


def artifacts_dir(tmp_path):
    path = Path(os.environ.get("TEST_ARTIFACTS_DIR") or tmp_path)
    path.mkdir(parents=True, exist_ok=True)
    return path


def paste_key(driver, key):
    from selenium.webdriver.common.by import By
    field = driver.find_element(By.ID, "key")
    field.send_keys(key)
    driver.find_element(By.CSS_SELECTOR, "#key-form button[type=submit]").click()


def wait_state(driver, state):
    from selenium.webdriver.support.ui import WebDriverWait
    WebDriverWait(driver, 30).until(
        lambda d: d.find_element("tag name", "body").get_attribute("data-state") == state)


def bars(driver):
    """Return ``{(day, model): (cost USD, height)}`` of the chart's bars."""
    from selenium.webdriver.common.by import By
    found = {}
    for rect in driver.find_elements(By.CSS_SELECTOR, "#chart rect.bar"):
        found[rect.get_attribute("data-day"), rect.get_attribute("data-model")] = (
            Decimal(rect.get_attribute("data-cost-usd")), float(rect.get_attribute("height")))
    return found


def test_the_page_draws_the_seeded_spend_and_keeps_the_key_in_the_session(seeded, browser,
                                                                           tmp_path):
    from selenium.webdriver.common.by import By
    gw, org, ci_key, url = seeded
    reconciled = subprocess.run([KILN, "credits", "reconcile"], capture_output=True, text=True,
                                timeout=120, env={**os.environ, "KILN_DATABASE_URL": url})
    assert reconciled.returncode == 0, reconciled.stdout + reconciled.stderr  # seeded as settled
    browser.get(gw.base_url + "/activity")
    assert browser.title == "Kiln activity"
    where = browser.find_element(By.ID, "where-keys").text  # where keys come from, before any
    assert "kiln key create" in where and "POST /v1/keys" in where
    paste_key(browser, "kiln-not-a-key")
    wait_state(browser, "error")
    assert "Incorrect API key" in browser.find_element(By.ID, "error").text
    paste_key(browser, org.key)
    wait_state(browser, "loaded")
    assert browser.execute_script("return sessionStorage.getItem('kiln.key')") == org.key
    assert browser.execute_script("return localStorage.length") == 0
    assert browser.find_element(By.ID, "key").get_attribute("value") == ""

    total = sum(s[3] for s in SEED)
    assert browser.find_element(By.ID, "balance").text == page_usd(10**10 - total)
    assert browser.find_element(By.ID, "held").text == "$0.00"
    assert browser.find_element(By.ID, "total").text == page_usd(total)
    assert browser.find_element(By.ID, "requests").text == str(3 * len(SEED))

    today = datetime.now(timezone.utc).date()
    expected = {}
    for age, model, _key, cost in SEED:
        day = (today - timedelta(days=age)).isoformat()
        expected[day, model] = expected.get((day, model), 0) + cost
    drawn = bars(browser)
    assert {k: v[0] for k, v in drawn.items()} == \
        {k: Decimal(v).scaleb(-9) for k, v in expected.items()}
    heights = {}
    for (day, _model), (_cost, height) in drawn.items():
        heights[day] = heights.get(day, 0) + height
    plot_height = 260 - 10 - 30  # the chart's height less its margins (activity.js)
    assert heights[today.isoformat()] == pytest.approx(plot_height, rel=1e-6)  # the top day
    yesterday = (today - timedelta(days=1)).isoformat()
    assert heights[yesterday] == pytest.approx(plot_height * 250_000 / 4_002_000, rel=1e-6)
    legend = [li.text for li in browser.find_elements(By.CSS_SELECTOR, "#legend li")]
    assert legend == ["fake-model", "fake-vision"]

    rows = {tr.get_attribute("data-prefix"): [td.text for td in tr.find_elements(By.TAG_NAME,
                                                                               "td")]
            for tr in browser.find_elements(By.CSS_SELECTOR, "#key-rows tr")}
    period = spent("ci", today, today.replace(day=1))
    assert rows[ci_key[:12]][:8] == ["ci-bot", ci_key[:12], "$0.01", "monthly", page_usd(period),
                                     page_usd(10**7 - period), "30",
                                     page_usd(spent("ci", today, today - timedelta(days=29)))]
    web = spent("web", today)  # it never resets: all its spend is this period's
    assert rows[org.key[:12]][:8] == ["test", org.key[:12], "unlimited", "never", page_usd(web),
                                      "unlimited", "unlimited", page_usd(web)]

    logs = [e for e in browser.get_log("browser") if "Content Security Policy" in e["message"]]
    assert logs == []
    resources = browser.execute_script(
        "return performance.getEntriesByType('resource').map(e => e.name)")
    assert resources and all(r.startswith(gw.base_url + "/") for r in resources)

    browser.refresh()  # the key is still in this tab's session: the page loads by itself
    wait_state(browser, "loaded")
    shot = artifacts_dir(tmp_path) / "activity-page.png"
    assert browser.save_screenshot(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")


def newest_first(url, org_id):
    """``[(id, cost nano-dollars, key label, model)]`` of the org's usage events in the listing's
    order, by the database: ``(started_at, id)`` descending (the seed's events share start
    times)."""
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        rows = conn.execute(sa.text(
            "SELECT e.id, e.cost_nanos, k.name, e.model FROM usage_events e JOIN api_keys k "
            "ON k.id = e.api_key_id WHERE e.org_id = :o ORDER BY e.started_at DESC, e.id DESC"),
            {"o": org_id}).all()
    engine.dispose()
    return [tuple(r) for r in rows]


def wait_action(driver):
    from selenium.webdriver.support.ui import WebDriverWait
    WebDriverWait(driver, 30).until(
        lambda d: d.find_element("tag name", "body").get_attribute("data-action") == "done")


def test_the_page_lists_the_requests_and_downloads_them_as_csv(seeded, browser, tmp_path):
    """The requests newest first, ten at a time ("Show more" fetches the next page by its
    cursor), each with its cost; the CSV link downloads every request with the key as a
    header (never in the URL), and the file's rows and cost sum are the seeded events'."""
    from selenium.webdriver.common.by import By
    gw, org, _ci_key, url = seeded
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    browser.execute_cdp_cmd("Page.setDownloadBehavior",
                            {"behavior": "allow", "downloadPath": str(downloads)})
    # Times are shown in the reader's zone: India's (UTC+05:30, no daylight saving) here.
    browser.execute_cdp_cmd("Emulation.setTimezoneOverride", {"timezoneId": "Asia/Kolkata"})
    browser.get(gw.base_url + "/activity")
    browser.execute_script("sessionStorage.clear()")
    browser.refresh()
    paste_key(browser, org.key)
    wait_state(browser, "loaded")
    events = newest_first(url, org.id)
    assert len(events) == 3 * len(SEED)

    def listed():
        return [tr.get_attribute("data-id")
                for tr in browser.find_elements(By.CSS_SELECTOR, "#request-rows tr")]
    assert listed() == [gid for gid, _cost, _label, _model in events[:10]]
    more = browser.find_element(By.ID, "more")
    assert more.is_displayed()
    more.click()
    wait_action(browser)
    assert listed() == [gid for gid, _cost, _label, _model in events]
    assert not more.is_displayed()
    first = [td.text for td in browser.find_elements(By.CSS_SELECTOR,
                                                     "#request-rows tr:first-child td")]
    gid, cost, label, model = events[0]
    today = datetime.now(timezone.utc).date().isoformat()  # seeded at 00:00:01 UTC
    assert first == [f"{today} 05:30:01", model, "chat", "completed", "4", "1", "2",
                     page_usd(cost), label, gid]
    assert browser.find_element(By.ID, "zone").text == "UTC+05:30"

    browser.find_element(By.ID, "csv").click()
    wait_action(browser)
    saved = downloads / "generations.csv"
    wait_until(lambda: saved.exists() and not list(downloads.glob("*.crdownload")),
               timeout_s=30)
    with saved.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["id"], Decimal(r["cost_usd"])) for r in rows] == \
        [(gid, Decimal(cost).scaleb(-9)) for gid, cost, _label, _model in events]
    assert sum(Decimal(r["cost_usd"]) for r in rows) == Decimal(sum(s[3] for s in SEED)).scaleb(-9)
    requested = browser.execute_script(
        "return performance.getEntriesByType('resource').map(e => e.name)")
    assert gw.base_url + "/v1/generations?format=csv" in requested
    assert not [r for r in requested if org.key in r]  # the key went as a header only
    logs = [e for e in browser.get_log("browser") if "Content Security Policy" in e["message"]]
    assert logs == []


def test_a_management_key_creates_rotates_and_revokes_keys_on_the_page(seeded, browser):
    """With a management key the page offers the keys API (docs/KEYS.md): a key made from the
    form works at once and its secret is shown once; Rotate shows a new secret that works;
    Revoke takes the key off the list; each change is in ``key_changes``. A key that cannot
    manage sees no form and no buttons."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select
    from gateway.ledger.key_admin import create_key_row
    gw, org, _ci_key, url = seeded
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        admin = create_key_row(conn, org.id, name="admin", manage=True)[1]

    def fresh_page(key):
        browser.get(gw.base_url + "/activity")
        browser.execute_script("sessionStorage.clear()")
        browser.refresh()
        paste_key(browser, key)
        wait_state(browser, "loaded")

    def row(label):
        for tr in browser.find_elements(By.CSS_SELECTOR, "#key-rows tr"):
            if tr.find_element(By.TAG_NAME, "td").text == label:
                return tr
        return None

    def works(secret):
        return requests.get(gw.base_url + "/v1/key", timeout=30,
                            headers={"Authorization": f"Bearer {secret}"}).status_code == 200

    fresh_page(org.key)
    assert not browser.find_element(By.ID, "manage").is_displayed()
    assert browser.find_elements(By.CSS_SELECTOR, "#key-rows button") == []

    fresh_page(admin)
    assert browser.find_element(By.ID, "manage").is_displayed()
    assert row("admin").find_elements(By.TAG_NAME, "button") == []  # the operator's to change
    browser.find_element(By.ID, "new-label").send_keys("page-bot")
    browser.find_element(By.ID, "new-limit").send_keys("0.50")
    Select(browser.find_element(By.ID, "new-reset")).select_by_value("monthly")
    browser.find_element(By.ID, "new-in-flight").send_keys("2")
    browser.find_element(By.CSS_SELECTOR, "#new-key button[type=submit]").click()
    wait_action(browser)
    made = browser.find_element(By.ID, "secret").get_attribute("data-key")
    assert made.startswith("kiln-") and works(made)
    assert row("page-bot") is not None
    with engine.connect() as conn:
        key = conn.execute(sa.text(
            "SELECT id, limit_usd, limit_reset, in_flight_limit FROM api_keys "
            "WHERE org_id = :o AND name = 'page-bot'"), {"o": org.id}).one()
    assert (key.limit_usd, key.limit_reset, key.in_flight_limit) == (Decimal("0.5"), "monthly", 2)

    row("page-bot").find_element(By.XPATH, ".//button[text()='Rotate']").click()
    wait_action(browser)
    rotated = browser.find_element(By.ID, "secret").get_attribute("data-key")
    assert rotated != made and works(rotated)
    row("page-bot").find_element(By.XPATH, ".//button[text()='Revoke']").click()
    wait_action(browser)
    assert row("page-bot") is None
    with engine.connect() as conn:
        actions = conn.execute(sa.text(
            "SELECT action, actor FROM key_changes WHERE api_key_id = :k ORDER BY id"),
            {"k": key.id}).all()
        assert conn.execute(sa.text("SELECT revoked_at IS NOT NULL FROM api_keys WHERE id = :k"),
                            {"k": key.id}).scalar_one()
    assert [tuple(a) for a in actions] == [("create", "key"), ("rotate", "key"), ("revoke", "key")]
    logs = [e for e in browser.get_log("browser") if "Content Security Policy" in e["message"]]
    assert logs == []
    engine.dispose()

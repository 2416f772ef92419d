"""The console in a real browser: Debian's headless Chromium driven by selenium
(``chromium`` and ``chromium-driver``, installed by .ci/run), against a real broker, a
real console process and real component processes.

The browser starts once for the module. Without Chromium the module is skipped on a
developer's machine and fails in CI (``$CI`` set), where .ci/run installs it.

The run writes the screenshots of docs/console/ (1280x800, and one phone-sized), so the
README's pictures show the page as it is.
"""

from __future__ import annotations

import itertools
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from console_helpers import Component, ConsoleProcess

ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "docs" / "console"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
#: Generous: the machine may be busy; the 2 s contract is checked on the console's own
#: update cadence (the page's timestamps), not on the wall clock of a loaded runner.
WAIT = 30.0

try:
    from selenium import webdriver
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    HAVE_SELENIUM = True
except ImportError:  # pragma: no cover - the dev extra brings it
    HAVE_SELENIUM = False

if not (CHROMIUM and DRIVER and HAVE_SELENIUM):
    missing = "selenium" if not HAVE_SELENIUM else "chromium and chromium-driver"
    if os.environ.get("CI"):
        pytest.fail(f"CI needs {missing} for the console's browser tests", pytrace=False)
    pytest.skip(f"no {missing} (apt-get install chromium chromium-driver)", allow_module_level=True)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM or ""
    for arg in (
        "--headless=new",
        "--no-sandbox",  # CI containers run as root
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1280,800",
        "--lang=en-GB",
    ):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    driver.set_page_load_timeout(WAIT)
    try:
        yield driver
    finally:
        driver.quit()


def viewport(driver: Any, width: int, height: int, mobile: bool = False) -> None:
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": mobile},
    )


def wait(driver: Any, cond: Any, timeout: float = WAIT) -> Any:
    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(cond)


def shot(driver: Any, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(SHOTS / name))


def tab(driver: Any, name: str) -> None:
    driver.find_element(By.ID, f"tab-{name}").click()
    wait(driver, ec.visibility_of_element_located((By.ID, name)))


def client_row(lname: str) -> tuple[str, str]:
    return (By.CSS_SELECTOR, f'#clients-table tr[data-lname="{lname}"]')


def accept_confirm(driver: Any) -> str:
    alert = wait(driver, ec.alert_is_present())
    text: str = alert.text
    alert.accept()
    return text


def taken_at(driver: Any) -> float:
    return float(driver.find_element(By.ID, "updated").get_attribute("data-taken-at") or 0)


def test_clients_appear_live_and_the_views(
    browser: Any,
    short_tmp: Path,
    broker_factory: Callable[..., Any],
    console_factory: Callable[..., ConsoleProcess],
    component: Callable[..., Component],
) -> None:
    """A client connected after the page opened appears without a reload, within one
    push interval of the console (2 s: its snapshots, as the page shows them, come 2 s
    apart); the main views render at 1280x800 and on a phone-sized viewport; tabs work
    with the keyboard; numbers are tabular."""
    b = broker_factory("--queue-dir", str(short_tmp / "queue"), "--plugin", "pipe")
    con = console_factory(b.path)  # the default interval: the 2 s contract
    viewport(browser, 1280, 800)
    browser.get(con.url + "#clients")
    wait(browser, ec.text_to_be_present_in_element((By.ID, "status"), "live"))

    comp = component(b.path)
    seen_before = taken_at(browser)
    wait(browser, ec.presence_of_element_located(client_row(comp.lname)))
    # The console pushed the client in the first snapshot taken after it connected.
    first_with = taken_at(browser)
    assert first_with > seen_before

    # The cadence: consecutive snapshots as the page received them, one interval apart.
    stamps = [first_with]
    while len(stamps) < 4:
        wait(browser, lambda d: taken_at(d) > stamps[-1])
        stamps.append(taken_at(browser))
    gaps = [y - x for x, y in itertools.pairwise(stamps)]
    assert all(1.5 <= g <= 2.0 + 4.0 for g in gaps), gaps
    assert sum(gaps) / len(gaps) < 2.5, gaps

    # More components and some calls, for the pictures.
    others = [component(b.path, "Xfrout", "xfrout"), component(b.path, "Zone.stats", "stats")]
    for o in others:
        wait(browser, ec.presence_of_element_located(client_row(o.lname)))
    num = browser.find_element(By.CSS_SELECTOR, "#clients-table td.num")
    assert num.value_of_css_property("font-variant-numeric") == "tabular-nums"
    # Times in the user's locale (Intl): the footer's time is not the raw epoch.
    assert ":" in browser.find_element(By.ID, "updated").text

    tab(browser, "broker")
    wait(browser, ec.text_to_be_present_in_element((By.ID, "plugins-table"), "running"))
    shot(browser, "broker.png")
    tab(browser, "clients")
    wait(browser, ec.presence_of_element_located(client_row(comp.lname)))
    shot(browser, "clients.png")

    # Keyboard: arrows move between tabs and show their panels.
    browser.find_element(By.ID, "tab-clients").send_keys(Keys.ARROW_RIGHT)
    wait(browser, ec.visibility_of_element_located((By.ID, "groups")))
    assert browser.switch_to.active_element.get_attribute("id") == "tab-groups"
    assert not browser.find_element(By.ID, "clients").is_displayed()
    shot(browser, "groups.png")

    tab(browser, "clients")
    # Keyboard focus survives the live updates: rows are updated in place, not rebuilt.
    button = browser.find_element(By.CSS_SELECTOR, f'button.drop[data-lname="{comp.lname}"]')
    browser.execute_script("arguments[0].focus()", button)
    seen = taken_at(browser)
    wait(browser, lambda d: taken_at(d) > seen)
    active = browser.switch_to.active_element
    assert active == button, active.get_attribute("outerHTML")

    # Filter: only the matching rows stay.
    f = browser.find_element(By.ID, "clients-filter")
    f.send_keys("xfrout")
    wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#clients-table tbody tr")) == 1)
    f.clear()
    f.send_keys(" ")  # input event; the filter trims it

    viewport(browser, 390, 844, mobile=True)
    browser.get(con.url + "#clients")
    wait(browser, ec.presence_of_element_located(client_row(comp.lname)))
    width = browser.execute_script("return document.documentElement.scrollWidth")
    assert width <= 390 + 1, f"the page scrolls sideways on a phone ({width} px)"
    shot(browser, "phone-clients.png")
    viewport(browser, 1280, 800)


def test_call_through_the_form_then_drop(
    browser: Any,
    broker: Any,
    console_factory: Callable[..., ConsoleProcess],
    component: Callable[..., Component],
) -> None:
    """The form is generated from the command's declaration; the call's result shows;
    a confirmed drop removes the client from the page."""
    con = console_factory(broker.path)
    comp = component(broker.path)
    viewport(browser, 1280, 800)
    # The live traffic view, filtered as `msgq-trio dump --kind command --target ZoneMgr`.
    browser.get(con.url + "#traffic")
    form = wait(browser, ec.visibility_of_element_located((By.ID, "traffic-form")))
    form.find_element(By.NAME, "kind").send_keys("command")
    form.find_element(By.NAME, "target").send_keys("ZoneMgr")
    browser.find_element(By.ID, "traffic-start").click()
    wait(browser, ec.element_to_be_clickable((By.ID, "traffic-stop")))
    tab(browser, "actions")
    browser.find_element(By.ID, "call-target").send_keys("ZoneMgr")
    browser.find_element(By.ID, "call-load").click()
    field = wait(browser, ec.presence_of_element_located((By.NAME, "p:zone_class")))
    wait(browser, lambda d: d.find_element(By.ID, "call-command").get_attribute("value"))
    assert browser.find_element(By.ID, "call-command").get_attribute("value") == "get_zone_count"
    assert browser.find_element(By.NAME, "p:verbose").get_attribute("type") == "checkbox"
    field.send_keys("CH")
    browser.find_element(By.ID, "call-submit").click()
    assert "get_zone_count" in accept_confirm(browser)
    wait(browser, ec.text_to_be_present_in_element((By.ID, "call-result"), "0"))
    assert browser.find_element(By.ID, "call-result").text.strip() == "0"

    # Raw JSON instead of the fields: the component's own error comes back.
    browser.find_element(By.ID, "call-raw").send_keys('{"zone_class": "XX"}')
    browser.find_element(By.ID, "call-submit").click()
    accept_confirm(browser)
    wait(browser, ec.text_to_be_present_in_element((By.ID, "call-result"), "not-found"))
    browser.find_element(By.ID, "call-raw").clear()
    field.clear()
    field.send_keys("IN")
    browser.find_element(By.ID, "call-submit").click()
    accept_confirm(browser)
    wait(browser, ec.text_to_be_present_in_element((By.ID, "call-result"), "42"))
    shot(browser, "call.png")

    tab(browser, "traffic")
    wait(browser, ec.text_to_be_present_in_element((By.ID, "traffic-table"), "get_zone_count"))
    kinds = {
        td.text for td in browser.find_elements(By.CSS_SELECTOR, "#traffic-table td:nth-child(2)")
    }
    assert kinds == {"command"}, kinds
    shot(browser, "traffic.png")
    browser.find_element(By.ID, "traffic-stop").click()

    tab(browser, "commands")
    wait(browser, ec.text_to_be_present_in_element((By.ID, "commands-table"), "get_zone_count"))
    shot(browser, "commands.png")

    tab(browser, "clients")
    wait(browser, ec.presence_of_element_located(client_row(comp.lname)))
    browser.find_element(By.CSS_SELECTOR, f'button.drop[data-lname="{comp.lname}"]').click()
    assert comp.lname in accept_confirm(browser)
    wait(browser, ec.invisibility_of_element_located(client_row(comp.lname)))
    broker.log_with(f"dropping client {comp.lname}", "audit: console drop by local web viewer")
    # A cancelled confirmation sends nothing.
    other = component(broker.path, "Other", "other")
    wait(browser, ec.presence_of_element_located(client_row(other.lname)))
    browser.find_element(By.CSS_SELECTOR, f'button.drop[data-lname="{other.lname}"]').click()
    wait(browser, ec.alert_is_present()).dismiss()
    time.sleep(1.0)
    assert other.proc.poll() is None
    assert browser.find_elements(*client_row(other.lname))


def test_refused_action_shows_the_brokers_error(
    browser: Any,
    broker_factory: Callable[..., Any],
    write_config: Callable[[str], Path],
    console_factory: Callable[..., ConsoleProcess],
    component: Callable[..., Component],
) -> None:
    """The console's identity may call ZoneMgr but not Xfrout (an access rule): the call
    through the form is refused by the broker, and the page shows its code and message;
    nothing reached the component."""
    rule = (
        "[[access.rule]]\n"
        f'who = ["uid:{os.getuid()}"]\n'
        'subscribe = ["*"]\nsend = ["*"]\ncall = ["ZoneMgr", "l.*"]\ncontrol = true\n'
    )
    b = broker_factory("--config", str(write_config(rule)))
    con = console_factory(b.path)
    component(b.path, "Xfrout", "xfrout")
    viewport(browser, 1280, 800)
    browser.get(con.url + "#actions")
    wait(browser, ec.visibility_of_element_located((By.ID, "call-target")))
    browser.find_element(By.ID, "call-target").send_keys("Xfrout")
    browser.find_element(By.ID, "call-command").send_keys("get_zone_count")
    browser.find_element(By.ID, "call-submit").click()
    accept_confirm(browser)
    try:
        wait(browser, ec.text_to_be_present_in_element((By.ID, "call-result"), "forbidden"))
    except TimeoutException:
        raise AssertionError(browser.find_element(By.ID, "call-result").text) from None
    text = browser.find_element(By.ID, "call-result").text
    assert text.startswith("refused: forbidden") and "Xfrout" in text, text
    b.log_with("audit: console call by local web viewer", "refused forbidden")

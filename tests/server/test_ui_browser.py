"""The web page in a real browser: headless Chromium (Debian's `chromium` and `chromium-driver`, driven by
selenium) against real `mlaserve serve` processes on 127.0.0.1 with the embedded model.

Checked against the server's own API, never against the page: the streamed chat answer equals the API's
greedy answer (temperature 0) and its token count the API's usage; the route view's decode and prefill
totals equal the sums over /debug/routes' segments and its bars are those steps'; the provenance table
lists is_sparse with the source /debug/config gives; the API-key prompt refuses a wrong key and keeps the
right one for the tab; a stopped server turns into a message, not a blank page.

Screenshots of each view are written to this run's pytest tmp folder (`<basetemp>/ui-screenshots*/`, the
path is printed), and also to $MLASERVE_UI_SCREENSHOTS when set (the README's images come from there).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from server_process import ServerProcess

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
if CHROMIUM is None or CHROMEDRIVER is None:
    pytest.skip(
        "the browser tests need Debian's chromium and chromium-driver (apt-get install -y chromium chromium-driver)",
        allow_module_level=True,
    )
webdriver = pytest.importorskip(
    "selenium.webdriver", reason="the browser tests need selenium (pip install -e '.[test]')"
)
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

pytestmark = pytest.mark.slow
# Without the background-networking flags Chromium opens connections of its own (updates, sync, QUIC
# probes); on a closed network they are refused many at a time and the page's own requests wait behind them.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1280,900",
)
WAIT_S = 30


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ui-screenshots")
    print(f"\nscreenshots of the web page: {folder}")
    return folder


def _save(driver, shots: Path, name: str) -> None:
    path = shots / f"{name}.png"
    driver.save_screenshot(str(path))
    assert path.stat().st_size > 5000, f"{name}: screenshot looks empty"
    extra = os.environ.get("MLASERVE_UI_SCREENSHOTS")
    if extra:
        Path(extra).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(extra) / path.name)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in FLAGS:
        opts.add_argument(flag)
    opts.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def servers():
    """Both servers, started at once (each start is mostly waiting on imports and loading): one with the
    debug endpoints and --verify; one behind an API key without the debug endpoints (the default)."""
    # index_topk 32 < the checkpoint's 64: the chat's context passes it (the indexer selects), and the
    # provenance table must mark the setting as differing from config.json. MTP speculation (the embedded
    # model has its MTP layer): greedy output is plain greedy's, and the route view has drafts to count.
    main_args = ("--enable-debug-endpoints", "--verify", "--index-topk", "32", "--speculative", "mtp")
    with ThreadPoolExecutor(2) as pool:
        main = pool.submit(ServerProcess, *main_args)
        keyed = pool.submit(ServerProcess, "--api-key", "sesame")
        started = {"main": main.result(), "keyed": keyed.result()}
    yield started
    for srv in started.values():
        srv.stop()


@pytest.fixture(scope="module")
def server(servers):
    return servers["main"]


def _wait(driver, what, timeout: float = WAIT_S):
    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(lambda d: what(d))


def _text(driver, css: str) -> str:
    return driver.find_element(By.CSS_SELECTOR, css).text


def _errors(driver) -> list[dict]:
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def _open(driver, server) -> None:
    """The page of this server, loaded unless it already is (each test runs alone too)."""
    if not driver.current_url.startswith(server.url):
        driver.get(server.url + "/")
    _wait(driver, lambda d: server.model in _text(d, "#model-name"))


def _tab(driver, view: str) -> None:
    driver.find_element(By.CSS_SELECTOR, f'.tab[data-view="{view}"]').click()
    _wait(driver, lambda d: d.find_element(By.ID, f"view-{view}").is_displayed())


def test_the_page_loads_without_console_errors(browser, server):
    browser.get(server.url + "/")
    _wait(browser, lambda d: server.model in _text(d, "#model-name"))
    time.sleep(1.5)  # a poll of each kind (health, routes, metrics) has run
    assert _errors(browser) == []
    assert not browser.find_element(By.ID, "banner").is_displayed()  # online: no message


def test_a_chat_message_streams_the_api_greedy_answer(browser, server, shots):
    _open(browser, server)
    prompt, settings = "Tell me about attention.", {"temperature": "0", "max_tokens": "24"}
    for name, value in settings.items():
        box = browser.find_element(By.ID, name)
        box.clear()
        box.send_keys(value)
    browser.find_element(By.ID, "chat-input").send_keys(prompt)
    browser.find_element(By.ID, "chat-send").click()
    _wait(browser, lambda d: d.find_element(By.ID, "chat-stats").get_attribute("data-completion-tokens"))
    shown = browser.execute_script("return document.querySelector('#messages .msg.assistant .text').textContent")
    tokens = int(browser.find_element(By.ID, "chat-stats").get_attribute("data-completion-tokens"))

    reference = server.client().chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=24
    )
    assert shown == reference.choices[0].message.content and shown
    assert tokens == reference.usage.completion_tokens
    raw = browser.execute_script("return document.getElementById('raw-response').textContent")
    # streamed: several content chunks (with MTP drafts a chunk may carry more than one token), then [DONE]
    assert raw.count('"content":') > 2 and raw.rstrip().endswith("data: [DONE]")
    assert "tokens/s" in _text(browser, "#chat-stats")
    assert _errors(browser) == []
    _save(browser, shots, "chat")


def _trunk(records: list[dict]) -> list[dict]:
    """The steps' own records (MTP's accept / draft / switch records are not routes of the trunk)."""
    return [r for r in records if r.get("spec_phase") in (None, "target", "verify")]


def _phase_totals(records: list[dict]) -> dict[str, int]:
    totals = {"decode": 0, "prefill": 0}
    for rec in _trunk(records):
        for seg in rec["segments"]:
            totals[seg["phase"]] += seg["num_tokens"]
    return totals


def test_the_route_chart_counts_what_debug_routes_holds(browser, server, shots):
    _open(browser, server)
    # a prefill, then decodes whose context passes index_topk 32 (the indexer selects: sparse top-k)
    body = {"model": server.model, "prompt": "And God said", "max_tokens": 36, "temperature": 0, "ignore_eos": True}
    assert server.post("/v1/completions", json=body).status_code == 200
    records = server.get("/debug/routes", params={"last": 500}).json()["records"]
    totals = _phase_totals(records)
    assert totals["decode"] > 0 and totals["prefill"] > 0
    _tab(browser, "route")

    def shown(d):
        return {p: int(_text(d, f"#phase-total-{p}")) for p in ("decode", "prefill")}

    # speculative decoding: the drafts accepted / proposed of the records' accept entries
    accepts = [r for r in records if r.get("spec_phase") == "accept"]
    proposed, accepted = (sum(r[k] for r in accepts) for k in ("num_proposed_tokens", "num_accepted_tokens"))
    assert proposed > 0
    spec = f"{accepted} / {proposed} drafts accepted"

    def spec_shown(d):
        return _text(d, '#route-counters tr[data-name="speculative"] td').startswith(spec)

    # The page polls each second and the server is idle now: wait for a poll that holds every record. The phase
    # totals alone can match one poll early (a step's accept record follows its step record: one draft short).
    _wait(browser, lambda d: shown(d) == totals and spec_shown(d))
    # read the bars in one script: the chart is redrawn at each poll, so element handles go stale
    bars = browser.execute_script(
        "return Array.from(document.querySelectorAll('#route-chart rect.bar')).map(b => "
        "[b.dataset.phase, Number(b.dataset.tokens), Number(b.dataset.step)])"
    )
    drawn = sorted(_trunk(records), key=lambda r: r["step"])[-60:]  # the chart draws the last 60 steps
    by_phase = {p: sum(n for ph, n, _ in bars if ph == p) for p in totals}
    assert by_phase == _phase_totals(drawn)  # each bar is its step's segment
    assert {step for _, _, step in bars} == {r["step"] for r in drawn}
    # the table by phase x path x mode (mode as `trace summarize` names it), against the records' segments
    table = browser.execute_script(
        "return Array.from(document.querySelectorAll('#route-totals tbody tr')).map(r => "
        "[r.dataset.phase, r.dataset.path, r.dataset.mode, Number(r.querySelector('td.count').textContent)])"
    )
    expected = {}
    for rec in _trunk(records):
        mode = "dense" if not rec["sparse"] else "sparse top-k" if rec["needs_selection"] else "sparse all rows"
        for seg in rec["segments"]:
            key = (seg["phase"], seg["path"], mode)
            expected[key] = expected.get(key, 0) + seg["num_tokens"]
    assert {tuple(row[:3]): row[3] for row in table} == expected
    assert any(mode == "sparse top-k" for _, _, mode in expected)  # past index_topk 32: the indexer selected
    row = browser.find_element(By.CSS_SELECTOR, '#route-counters tr[data-name="speculative"] td').text
    assert row.startswith(spec), row
    assert browser.find_elements(By.CSS_SELECTOR, "#spec-chart path.spark-line")
    scored = {}
    for rec in _trunk(records):
        for seg in rec["segments"]:
            if seg["index_scoring"]:
                scored[seg["index_scoring"]] = scored.get(seg["index_scoring"], 0) + seg["num_tokens"]
    row = browser.find_element(By.CSS_SELECTOR, '#route-counters tr[data-name="index scoring"] td').text
    assert scored and row == ", ".join(f"{k} ({n} tokens)" for k, n in scored.items()), row
    step = next(step for ph, _, step in bars if ph == "prefill")
    # a bar may be a few pixels high: click its step by event, not by coordinates
    browser.execute_script(
        "document.querySelector(`#route-chart g.step[data-step='${arguments[0]}']`)"
        ".dispatchEvent(new MouseEvent('click', {bubbles: true}))",
        step,
    )
    _wait(browser, lambda d: f'"step": {step}' in _text(d, "#step-detail"))
    assert '"phase": "prefill"' in _text(browser, "#step-detail")
    assert _errors(browser) == []
    _save(browser, shots, "route")


def test_the_configuration_view_lists_is_sparse_with_its_source(browser, server, shots):
    _open(browser, server)
    expected = {r["name"]: r for r in server.get("/debug/config").json()["provenance"]}["is_sparse"]
    _tab(browser, "config")
    row = _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, '#provenance tr[data-name="is_sparse"]'))[0]
    assert row.find_element(By.CSS_SELECTOR, "td.value").text == "true"
    assert row.find_element(By.CSS_SELECTOR, "td.source").text == expected["source"]
    assert "indexer weights" in expected["source"]
    assert row.find_element(By.CSS_SELECTOR, "td.mark").text == ""  # not a config.json key
    topk = browser.find_element(By.CSS_SELECTOR, '#provenance tr[data-name="index_topk"]')
    cells = [topk.find_element(By.CSS_SELECTOR, f"td.{c}").text for c in ("mark", "value", "source", "checkpoint")]
    assert cells == ["≠", "32", "user option", "64"] and "differs" in topk.get_attribute("class")
    marked = browser.find_elements(By.CSS_SELECTOR, "#provenance tr.differs")
    assert [r.get_attribute("data-name") for r in marked] == ["index_topk"]
    verify = _text(browser, "#verify")  # the server ran with --verify
    assert "every check passed" in verify and "absorbed vs decompressed" in verify
    assert _text(browser, "#kernels tbody")  # the kernel plan's rows
    _wait(browser, lambda d: "no data yet" not in _text(d, '#metric-plots [data-key="mlaserve_kv_pages_in_use"]'))
    assert _errors(browser) == []
    _save(browser, shots, "config")


def test_tensor_parallel_ranks_side_by_side_with_a_disagreement_marked(browser, server, shots):
    # A TP server's ranks run the same route, so a real one never disagrees: the page is handed this
    # server's own records as ranks 0 and 1, rank 1 changed at one step, and must mark exactly that step.
    body = {"model": server.model, "prompt": "In the beginning", "max_tokens": 3, "temperature": 0}
    assert server.post("/v1/completions", json=body).status_code == 200  # three steps of its own
    records = _trunk(server.get("/debug/routes", params={"last": 50}).json()["records"])[-3:]
    _open(browser, server)
    bad = records[1]["step"]
    ranks = []
    for rank in (0, 1):
        for rec in records:
            rec = json.loads(json.dumps(rec)) | {"rank": rank}
            if rank == 1 and rec["step"] == bad:
                rec["segments"][0]["num_tokens"] += 1
            ranks.append(rec)
    _tab(browser, "route")
    browser.execute_script(
        "state.debugOff = true; state.records.clear();"  # polling stops: only these records
        "for (const r of arguments[0]) state.records.set(recordKey(r), r); drawRoute();",
        ranks,
    )
    assert "disagree at step(s) " + str(bad) in _text(browser, "#ranks-summary")
    marked = browser.execute_script(
        "return Array.from(document.querySelectorAll('#route-chart g.step.disagree')).map(g => Number(g.dataset.step))"
    )
    assert marked == [bad]
    browser.execute_script(
        f"document.querySelector(`#route-chart g.step[data-step='{bad}']`).dispatchEvent(new MouseEvent('click', {{bubbles: true}}))"
    )
    columns = browser.find_elements(By.CSS_SELECTOR, "#step-detail .rank-col")
    titles = [c.find_element(By.TAG_NAME, "h3").text.split() for c in columns]  # "rank 0 verify", ...
    assert [t[:2] for t in titles] == [["rank", "0"], ["rank", "1"]] and titles[0][2] == titles[1][2]
    assert all("disagree" in c.get_attribute("class") for c in columns)
    _save(browser, shots, "route-ranks")
    browser.refresh()  # back to the server's own records for the next view


def test_the_api_key_prompt_then_a_server_gone_is_a_message(browser, servers, shots):
    keyed = servers["keyed"]
    try:
        browser.get(keyed.url + "/")  # the page itself is public, and says a key is needed (/ui/server.json)
        dialog = _wait(
            browser,
            lambda d: d.find_element(By.ID, "key-dialog").is_displayed() and d.find_element(By.ID, "key-dialog"),
        )
        assert _errors(browser) == []  # asked before any call: no refused request
        _save(browser, shots, "api-key")
        box = browser.find_element(By.ID, "key-input")
        box.send_keys("wrong")
        browser.find_element(By.ID, "key-save").click()
        _wait(browser, lambda d: "refused" in _text(d, "#key-message"))  # asked again, saying why
        _errors(browser)  # the refused call is logged; reading the log empties it
        box.send_keys("sesame")
        browser.find_element(By.ID, "key-save").click()
        _wait(browser, lambda d: keyed.model in _text(d, "#model-name"))
        assert not dialog.is_displayed()
        assert browser.execute_script("return sessionStorage.getItem('mlaserve-api-key')") == "sesame"
        browser.refresh()  # kept for the tab: no second prompt
        _wait(browser, lambda d: keyed.model in _text(d, "#model-name"))
        assert not browser.find_element(By.ID, "key-dialog").is_displayed()
        # the views that read the debug endpoints say what is off and the flag that turns it on
        _tab(browser, "route")
        _wait(browser, lambda d: "--enable-debug-endpoints" in _text(d, "#route-note"))
        _tab(browser, "config")
        _wait(browser, lambda d: "--enable-debug-endpoints" in _text(d, "#config-note"))
        assert _errors(browser) == []  # the page never called an endpoint that is off (no 404)
    finally:
        keyed.stop(signal.SIGTERM)
    banner = _wait(
        browser, lambda d: d.find_element(By.ID, "banner").is_displayed() and d.find_element(By.ID, "banner")
    )
    assert "is not answering" in banner.text and keyed.url in banner.text
    _save(browser, shots, "server-gone")

"""The console over HTTP: a real broker, a real ``msgq-trio console`` process, real
client processes; the viewer is urllib with a cookie jar."""

from __future__ import annotations

import itertools
import json
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from console_helpers import Component, ConsoleProcess, Viewer

PY = sys.executable


def lnames(doc: dict[str, Any]) -> set[str]:
    return {c["lname"] for c in doc.get("clients") or ()}


def test_page_snapshot_and_events(
    broker: Any,
    console_factory: Callable[..., ConsoleProcess],
    component: Callable[..., Component],
    viewer: Callable[[str], Viewer],
) -> None:
    """The page comes with a strict CSP and an HttpOnly session cookie; the snapshot
    shows the broker and a client connected after the console started, with its groups;
    the event stream pushes one document per interval (the console's cadence)."""
    con = console_factory(broker.path, "--interval", "0.5")
    v = viewer(con.url)
    status, headers, _ = v.request("/api/snapshot")
    assert status == 401  # no session yet: the page makes it
    page = v.open_page()
    assert "/static/app.js" in page and "http" not in page.split("<body>")[1].split("</body>")[0]
    status, headers, _ = v.request("/")
    assert "script-src 'self'" in headers["content-security-policy"]
    (cookie,) = list(v.jar)
    assert cookie.has_nonstandard_attr("HttpOnly")
    for path in ("/static/app.js", "/static/style.css", "/static/icon.svg"):
        assert v.request(path)[0] == 200, path

    comp = component(broker.path)
    doc = v.wait_snapshot(lambda d: comp.lname in lnames(d))
    row = next(c for c in doc["clients"] if c["lname"] == comp.lname)
    assert row["name"] == "zonemgr" and "ZoneMgr" in row["groups"]
    assert row["identity"].startswith("pid ")
    assert doc["broker"]["version"] and doc["broker"]["listeners"] == [f"unix:{broker.path}"]
    assert {"group": "ZoneMgr", "members": [{"lname": comp.lname, "name": "zonemgr"}]} in doc[
        "groups"
    ]

    # The event stream: consecutive documents half a second apart (start to start).
    req = urllib.request.Request(con.url + "api/events")
    taken = []
    with v.opener.open(req, timeout=30) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        for raw in resp:
            line = raw.decode().rstrip("\n")
            if line.startswith("data: "):
                taken.append(json.loads(line[6:])["taken_at"])
                if len(taken) == 6:
                    break
    gaps = [b - a for a, b in itertools.pairwise(taken[1:])]
    # Never faster than the interval; on a busy machine a snapshot may take longer than
    # it, but the typical gap is the interval (start to start, no drift).
    assert all(g > 0.4 for g in gaps), gaps
    assert statistics.median(gaps) < 1.0, gaps


def test_call_drop_and_audit(
    broker: Any,
    console_factory: Callable[..., ConsoleProcess],
    component: Callable[..., Component],
    viewer: Callable[[str], Viewer],
) -> None:
    """A call through the console reaches the component and returns its answer (and its
    error code when it fails); a drop removes the client; each action is a line in the
    broker's log naming the viewer; an action without the page's CSRF token is refused
    and nothing is sent."""
    con = console_factory(broker.path, "--interval", "0.5")
    comp = component(broker.path)
    v = viewer(con.url)
    v.open_page()
    v.wait_snapshot(lambda d: comp.lname in lnames(d))

    status, desc = v.request("/api/describe?target=ZoneMgr")[0], None
    assert status == 200
    desc = json.loads(v.request("/api/describe?target=ZoneMgr")[2])
    (cmd,) = desc[0]["members"][0]["description"]["commands"]
    assert cmd["name"] == "get_zone_count"

    status, r = v.act(
        {"action": "call", "target": "ZoneMgr", "command": "get_zone_count", "params": {}}
    )
    assert (status, r) == (200, {"ok": True, "result": 42})
    status, r = v.act(
        {
            "action": "call",
            "target": "ZoneMgr",
            "command": "get_zone_count",
            "params": {"zone_class": "XX"},
        }
    )
    assert status == 200 and r["ok"] is False and r["code"] == "not-found", r
    broker.log_with("audit: console call by local web viewer", "refused not-found")

    # Without the CSRF token: refused by the console, the client stays.
    status, r = v.act({"action": "drop", "lname": comp.lname}, csrf="")
    assert status == 403 and "CSRF" in r["error"]
    status, r = v.act({"action": "drop", "lname": comp.lname}, csrf="x" * 43)
    assert status == 403
    assert comp.proc.poll() is None

    status, r = v.act({"action": "drop", "lname": comp.lname})
    assert status == 200 and r["ok"] and r["result"]["lname"] == comp.lname, r
    v.wait_snapshot(lambda d: comp.lname not in lnames(d))
    broker.log_with(f"dropping client {comp.lname}", "dropped from the web console by local")
    broker.log_with("audit: console drop by local web viewer at 127.0.0.1")

    # Malformed actions are the viewer's fault: 400, named.
    status, r = v.act({"action": "explode"})
    assert status == 400 and "unknown action" in r["error"]
    status, r = v.act({"action": "drop"})
    assert status == 400 and "'lname'" in r["error"]
    status, _, body = v.request("/api/action", data=b"{nope", headers={"X-CSRF-Token": v.csrf})
    assert status == 400 and b"not JSON" in body


def test_refused_action_shows_the_brokers_error(
    broker_factory: Callable[..., Any],
    write_config: Callable[[str], Path],
    console_factory: Callable[..., ConsoleProcess],
    component: Callable[..., Component],
    viewer: Callable[[str], Viewer],
) -> None:
    """A console whose connection may not use control commands (control.allow_uids names
    another uid): the snapshot says which sources were refused, and a drop is answered
    with the broker's own ``forbidden``; the client stays."""
    cfg = write_config("[control]\nallow_uids = [4242424]\n")
    b = broker_factory("--config", str(cfg))
    con = console_factory(b.path, "--interval", "0.5")
    comp = component(b.path)
    v = viewer(con.url)
    v.open_page()
    doc = v.wait_snapshot(lambda d: "clients" in (d.get("errors") or {}))
    assert doc["errors"]["clients"].startswith("forbidden")
    status, r = v.act({"action": "drop", "lname": comp.lname})
    assert status == 200 and r["ok"] is False and r["code"] == "forbidden", r
    assert "4242424" in r["message"]
    assert comp.proc.poll() is None
    # Calls to components are not control commands: they still go through.
    status, r = v.act(
        {"action": "call", "target": "ZoneMgr", "command": "get_zone_count", "params": None}
    )
    assert r == {"ok": True, "result": 42}


def test_console_survives_a_broker_restart(
    broker_factory: Callable[..., Any],
    short_tmp: Path,
    console_factory: Callable[..., ConsoleProcess],
    viewer: Callable[[str], Viewer],
) -> None:
    """The broker SIGKILLed: the page says it is unreachable; once a broker is back on
    the socket the console reconnects by itself."""
    path = short_tmp / "r.sock"
    b = broker_factory(path=path)
    con = console_factory(path, "--interval", "0.3")
    v = viewer(con.url)
    v.open_page()
    v.wait_snapshot(lambda d: bool(d.get("clients")))
    b.kill()
    doc = v.wait_snapshot(lambda d: "broker" in (d.get("errors") or {}))
    assert "unreachable" in doc["errors"]["broker"]
    broker_factory(path=path)
    v.wait_snapshot(lambda d: bool(d.get("clients")) and not d.get("errors"))


def test_listen_rules(broker: Any, short_tmp: Path) -> None:
    """A non-loopback address without TLS, or without a broker that checks tokens, is
    refused at start with one line saying what is missing (exit status 2)."""

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [PY, "-m", "msgq_trio", "console", "-s", str(broker.path), *argv],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    r = run("--listen", "0.0.0.0:0")
    assert r.returncode == 2 and "not loopback" in r.stderr and "TLS" in r.stderr, r.stderr
    cert, key = short_tmp / "c.pem", short_tmp / "k.pem"
    cert.write_text("x")
    key.write_text("x")
    r = run("--listen", "0.0.0.0:0", "--tls-certfile", str(cert), "--tls-keyfile", str(key))
    assert r.returncode == 2 and "tcp:// or tls://" in r.stderr, r.stderr
    r = run("--login", "--listen", "127.0.0.1:0")
    assert r.returncode == 2 and "--login needs" in r.stderr, r.stderr
    r = run("--listen", "nonsense")
    assert r.returncode == 2 and "HOST:PORT" in r.stderr, r.stderr
    r = run("--tls-certfile", str(cert))
    assert r.returncode == 2 and "go together" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_address_in_use_is_one_line(broker: Any, short_tmp: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        started = time.monotonic()
        r = subprocess.run(
            [
                PY,
                "-m",
                "msgq_trio",
                "console",
                "-s",
                str(broker.path),
                "--listen",
                f"127.0.0.1:{port}",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert r.returncode == 2 and "cannot listen" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and time.monotonic() - started < 60


def test_login_with_broker_tokens(
    broker_factory: Callable[..., Any],
    write_config: Callable[[str], Path],
    console_factory: Callable[..., ConsoleProcess],
    component: Callable[..., Component],
    viewer: Callable[[str], Viewer],
) -> None:
    """``--login``: nothing without a session; a wrong token is refused by the broker; a
    viewer's actions run on a connection made with its token, so the broker's access
    rules decide (bob may call ZoneMgr but not drop; alice may drop) and its log names
    the identity; the token is never in a URL; logging out ends the session."""
    from msgq_trio.core.access import hash_token

    tokens = {"console": "c" * 32, "alice": "a" * 32, "bob": "b" * 32}
    cfg = write_config(
        '[tcp]\nlisten = ["127.0.0.1:0"]\ninsecure = true\ntokens = { '
        + ", ".join(f'{k} = "{hash_token(v)}"' for k, v in tokens.items())
        + " }\n"
        '[[access.rule]]\nwho = ["tcp:console", "tcp:alice"]\ncontrol = true\ncall = ["*"]\n'
        '[[access.rule]]\nwho = ["tcp:bob"]\ncall = ["ZoneMgr"]\n'
    )
    b = broker_factory("--config", str(cfg))
    url = b.log_with("listening on tcp://").split("listening on tcp://")[1].split()[0]
    con = console_factory(f"tcp://{url}", "--login", "--token", tokens["console"])
    comp = component(b.path)

    v = viewer(con.url)
    status, _, body = v.request("/")
    assert status == 200 and b'name="token"' in body  # redirected to the login form
    assert v.request("/api/snapshot")[0] == 401
    assert v.act({"action": "drop", "lname": comp.lname})[0] == 401
    status, _, body = v.request("/login", data=b"token=" + b"x" * 32)
    assert status == 403 and b"refused the login" in body
    assert not list(v.jar)

    bob = viewer(con.url)
    status, _, body = bob.request("/login", data=f"token={tokens['bob']}".encode())
    assert status == 200 and tokens["bob"].encode() not in body
    page = bob.open_page()
    assert "tcp:bob@127.0.0.1" in page
    bob.wait_snapshot(lambda d: comp.lname in lnames(d))
    status, r = bob.act({"action": "drop", "lname": comp.lname})
    assert r["ok"] is False and r["code"] == "forbidden", r
    status, r = bob.act(
        {"action": "call", "target": "ZoneMgr", "command": "get_zone_count", "params": None}
    )
    assert r == {"ok": True, "result": 42}
    b.log_with("audit: console drop by tcp:bob@127.0.0.1", "refused forbidden")

    alice = viewer(con.url)
    alice.request("/login", data=f"token={tokens['alice']}".encode())
    alice.open_page()
    status, r = alice.act({"action": "drop", "lname": comp.lname})
    assert r["ok"] is True, r
    b.log_with("dropped from the web console by tcp:alice@127.0.0.1")

    status, _, _ = bob.request("/logout", data=b"", headers={"X-CSRF-Token": bob.csrf})
    assert bob.request("/api/snapshot")[0] == 401


def test_queues_notify_capture_and_traffic(
    broker_factory: Callable[..., Any],
    short_tmp: Path,
    console_factory: Callable[..., ConsoleProcess],
    component: Callable[..., Component],
    viewer: Callable[[str], Viewer],
) -> None:
    """The queue plugin's queues with their depth, a purge through the console; a
    notification reaches a subscriber; a capture starts and stops; the live traffic view
    streams the records its filter selects (and not the console's own polling)."""
    import msgq_trio.sync

    b = broker_factory("--queue-dir", str(short_tmp / "queue"))
    con = console_factory(b.path, "--interval", "0.5")
    comp = component(b.path)
    v = viewer(con.url)
    v.open_page()
    with msgq_trio.sync.connect(b.path, "producer") as bus:
        q = bus.queue("jobs")
        q.declare()
        for i in range(3):
            q.put({"job": i})
        bus.subscribe("Zones")
        doc = v.wait_snapshot(lambda d: [r.get("depth") for r in d["queues"]] == [3])
        assert doc["queues"][0]["queue"] == "jobs"
        status, r = v.act({"action": "purge", "queue": "jobs"})
        assert r == {"ok": True, "result": 3}, r
        v.wait_snapshot(lambda d: [r.get("depth") for r in d["queues"]] == [0])
        b.log_with("audit: console purge by local web viewer")

        status, r = v.act(
            {"action": "notify", "group": "Zones", "event": "zone_added", "params": {"z": 1}}
        )
        assert r == {"ok": True, "result": None}, r
        msg = bus.receive(timeout=10)
        assert (msg.event, msg.body) == ("zone_added", {"z": 1})

    status, r = v.act({"action": "capture-start", "params": {"dir": str(short_tmp / "cap")}})
    assert r["ok"] and r["result"]["state"] == "running", r
    status, r = v.act({"action": "capture-stop"})
    assert r["ok"], r
    status, r = v.act({"action": "capture-start", "params": {"kinds": ["nonsense"]}})
    assert status == 200 and r["ok"] is False and r["code"] == "bad-request", r

    req = urllib.request.Request(con.url + "api/traffic?kind=command&target=ZoneMgr")
    with v.opener.open(req, timeout=30) as stream:
        assert stream.readline().startswith(b": started")
        _, r = v.act(
            {"action": "call", "target": "ZoneMgr", "command": "get_zone_count", "params": {}}
        )
        assert r["ok"], r
        for raw in stream:
            line = raw.decode()
            if line.startswith("data: "):
                recs = json.loads(line[6:])["records"]
                assert all(rec["kind"] == "command" for rec in recs), recs
                if any(rec.get("command") == "get_zone_count" for rec in recs):
                    break
    assert comp.proc.poll() is None


def test_https_with_a_certificate(
    broker: Any,
    short_tmp: Path,
    console_factory: Callable[..., ConsoleProcess],
) -> None:
    """``--tls-certfile``/``--tls-keyfile``: the page over HTTPS, its session cookie
    marked Secure; the URL printed says https."""
    import ssl

    import trustme

    ca = trustme.CA()
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(
        str(short_tmp / "web.pem")
    )
    pem = str(short_tmp / "web.pem")
    con = console_factory(broker.path, "--tls-certfile", pem, "--tls-keyfile", pem)
    assert con.url.startswith("https://127.0.0.1:")
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    v = Viewer(con.url)
    v.opener = urllib.request.build_opener(
        urllib.request.HTTPCookieProcessor(v.jar), urllib.request.HTTPSHandler(context=ctx)
    )
    v.open_page()
    (cookie,) = list(v.jar)
    assert cookie.secure and cookie.has_nonstandard_attr("HttpOnly")
    assert v.snapshot()["broker"]["version"]

// msgq-trio console: renders the snapshots the console pushes (server-sent events) and
// sends the actions. Data goes into the page as text nodes only, never as HTML.
"use strict";
(function () {
  const $ = (sel) => document.querySelector(sel);
  const csrf = document.querySelector('meta[name="csrf-token"]').content;
  const dateFmt = new Intl.DateTimeFormat(undefined, { dateStyle: "short", timeStyle: "medium" });
  const timeFmt = new Intl.DateTimeFormat(undefined, { timeStyle: "medium" });
  const numFmt = new Intl.NumberFormat(undefined, { maximumFractionDigits: 1 });
  let doc = null;
  const sorts = {};  // table id -> {key, dir}

  // -- helpers ------------------------------------------------------------------------
  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") e.className = v; else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
      else e.setAttribute(k, v);
    }
    for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(c == null ? "" : String(c)));
    return e;
  }
  const num = (v) => (v == null ? "–" : numFmt.format(v));
  function bytes(n) {
    if (n == null) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return (i ? n.toFixed(1) : String(n)) + " " + units[i];
  }
  function age(s) {
    if (s == null) return "–";
    if (s < 60) return s.toFixed(s < 10 ? 1 : 0) + " s";
    if (s < 3600) return Math.floor(s / 60) + " min " + Math.floor(s % 60) + " s";
    if (s < 86400) return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
    return Math.floor(s / 86400) + " d " + Math.floor((s % 86400) / 3600) + " h";
  }
  function latency(v, over) {
    if (over) return "> 60 s";
    if (v == null) return "–";
    return v < 1e-3 ? (v * 1e6).toFixed(0) + " µs" : v < 1 ? (v * 1e3).toFixed(1) + " ms" : v.toFixed(1) + " s";
  }
  function fill(tbody, rows) {
    tbody.replaceChildren(...rows);
  }
  // Update a table in place, one row per key: cells change their text only when it
  // changed, rows move only when the order did, so a focused button keeps its focus and
  // the browser redoes little work per push (1,000 clients every 2 s).
  function syncRows(tbody, rows, keyAttr, key, cells, action) {
    const old = new Map();
    for (const tr of Array.from(tbody.rows)) old.set(tr.getAttribute(keyAttr), tr);
    let i = 0;
    for (const r of rows) {
      const k = key(r), texts = cells(r);
      let tr = old.get(k);
      if (tr) old.delete(k);
      else {
        tr = el("tr", { [keyAttr]: k });
        for (const c of texts) tr.append(el("td", c.cls ? { class: c.cls } : {}));
        if (action) tr.append(el("td", {}, action(r)));
      }
      texts.forEach((c, j) => {
        const td = tr.cells[j];
        if (td.textContent !== c.t) td.textContent = c.t;
        if (c.title !== undefined && td.title !== c.title) td.title = c.title;
      });
      if (tbody.rows[i] !== tr) tbody.insertBefore(tr, tbody.rows[i] || null);
      i++;
    }
    for (const tr of old.values()) tr.remove();
  }
  const T = (t, cls, title) => ({ t: t == null ? "" : String(t), cls, title });
  function show(pre, ok, text) {
    pre.textContent = text;
    pre.className = "result " + (ok ? "good" : "bad");
  }

  // -- actions ------------------------------------------------------------------------
  async function act(action, confirmText) {
    if (confirmText && !window.confirm(confirmText)) return null;
    let resp;
    try {
      resp = await fetch("/api/action", {
        method: "POST", credentials: "same-origin",
        headers: { "Content-Type": "application/json", "X-CSRF-Token": csrf },
        body: JSON.stringify(action),
      });
    } catch (e) {
      return { ok: false, code: "console-unreachable", message: String(e) };
    }
    const body = await resp.json().catch(() => ({ error: "the console answered " + resp.status }));
    if (!resp.ok) return { ok: false, code: "console", message: body.error || String(resp.status) };
    return body;
  }
  function outcome(r) {
    if (r.ok) return JSON.stringify(r.result, null, 2);
    return "refused: " + r.code + ": " + r.message;
  }
  function notice(text) {
    const n = $("#notice");
    n.textContent = text;
    n.hidden = !text;
  }

  // -- tabs ---------------------------------------------------------------------------
  const tabs = Array.from(document.querySelectorAll('[role="tab"]'));
  function selectTab(id, focus) {
    for (const t of tabs) {
      const on = t.getAttribute("href") === "#" + id;
      t.setAttribute("aria-selected", on ? "true" : "false");
      t.tabIndex = on ? 0 : -1;
      document.getElementById(t.getAttribute("href").slice(1)).hidden = !on;
      if (on && focus) t.focus();
    }
  }
  function route() {
    const id = location.hash.slice(1);
    selectTab(tabs.some((t) => t.getAttribute("href") === "#" + id) ? id : "broker", false);
    listen();
    render();
  }
  window.addEventListener("hashchange", route);
  $("#tabs").addEventListener("keydown", (ev) => {
    const i = tabs.indexOf(document.activeElement);
    if (i < 0) return;
    const next = { ArrowRight: i + 1, ArrowLeft: i - 1, Home: 0, End: tabs.length - 1 }[ev.key];
    if (next === undefined) return;
    ev.preventDefault();
    const t = tabs[(next + tabs.length) % tabs.length];
    location.hash = t.getAttribute("href");
    selectTab(t.getAttribute("href").slice(1), true);
  });

  // -- sorting ------------------------------------------------------------------------
  for (const table of document.querySelectorAll("table.sortable")) {
    for (const th of table.querySelectorAll("th[data-key]")) {
      const label = th.textContent;
      const b = el("button", { type: "button" }, label);
      th.replaceChildren(b);
      b.addEventListener("click", () => {
        const cur = sorts[table.id];
        const dir = cur && cur.key === th.dataset.key && cur.dir === 1 ? -1 : 1;
        sorts[table.id] = { key: th.dataset.key, dir };
        for (const o of table.querySelectorAll("th")) o.removeAttribute("aria-sort");
        th.setAttribute("aria-sort", dir === 1 ? "ascending" : "descending");
        render();
      });
    }
  }
  function sorted(tableId, rows) {
    const s = sorts[tableId];
    if (!s) return rows;
    return rows.slice().sort((a, b) => {
      let x = a[s.key], y = b[s.key];
      if (Array.isArray(x)) { x = x.join(","); y = y.join(","); }
      if (x == null) return 1; if (y == null) return -1;
      return (x < y ? -1 : x > y ? 1 : 0) * s.dir;
    });
  }

  // -- views --------------------------------------------------------------------------
  function renderBroker(b) {
    const items = [
      ["Version", b.version + " (protocol " + b.protocol + ")"],
      ["Uptime", age(b.uptime)],
      ["Configuration", b.config_file + " (generation " + b.config_generation + ")"],
      ["Listeners", b.listeners.join(", ") || "–"],
      ["Connections", num(b.connections)],
      ["Pending requests", num(b.pending_requests)],
      ["Queued", bytes(b.queued_bytes)],
      ["Memory (RSS)", bytes(b.rss_bytes)],
    ];
    $("#broker-card").replaceChildren(...items.map(([k, v]) => el("div", {}, el("dt", {}, k), el("dd", {}, v))));
    fill($("#plugins-table tbody"), b.plugins.map((p) =>
      el("tr", {}, el("td", {}, p.name), el("td", {}, p.group), el("td", { class: "state-" + p.state }, p.state))));
    const c = b.capture || {};
    $("#capture-state").textContent = "Capture: " + (c.state || "off") +
      (c.records_written_total != null ? ", " + num(c.records_written_total) + " records written" : "");
  }
  function renderChart(rates) {
    const w = 600, h = 160, pad = 4;
    const n = rates.length;
    let peak = 1;
    for (const r of rates) peak = Math.max(peak, r.in, r.out);
    const x = (i) => (n <= 1 ? w : (i / (n - 1)) * w);
    const y = (v) => h - pad - (v / peak) * (h - 2 * pad);
    $("#chart-in").setAttribute("points", rates.map((r, i) => x(i).toFixed(1) + "," + y(r.in).toFixed(1)).join(" "));
    $("#chart-out").setAttribute("points", rates.map((r, i) => x(i).toFixed(1) + "," + y(r.out).toFixed(1)).join(" "));
    $("#chart-grid").replaceChildren(...[0.25, 0.5, 0.75].map((f) => {
      const l = document.createElementNS("http://www.w3.org/2000/svg", "line");
      l.setAttribute("x1", 0); l.setAttribute("x2", w); l.setAttribute("y1", h * f); l.setAttribute("y2", h * f);
      return l;
    }));
    $("#chart-peak").textContent = num(peak);
  }
  function renderClients(rows, total) {
    const q = $("#clients-filter").value.trim().toLowerCase();
    const shown = sorted("clients-table", rows.filter((r) => !q ||
      [r.lname, r.name, r.identity, r.groups.join(" ")].some((s) => s.toLowerCase().includes(q))));
    $("#clients-count").textContent = "(" + shown.length + " of " + total + ")";
    syncRows($("#clients-table tbody"), shown, "data-lname", (r) => r.lname, (r) => [
      T(r.lname), T(r.name), T(r.identity), T(r.groups.join(", "), "wrap"),
      T(bytes(r.queued_bytes), "num"), T(num(r.msgs_in), "num"), T(num(r.msgs_out), "num"),
      T(age(r.connected_for), "num", "since " + dateFmt.format(new Date(r.connected_at * 1000))),
    ], (r) => el("button", {
      type: "button", class: "danger drop", "data-lname": r.lname,
      "aria-label": "Drop " + r.lname + " (" + r.name + ")",
      onclick: () => dropClient(r),
    }, "Drop"));
  }
  async function dropClient(r) {
    const res = await act({ action: "drop", lname: r.lname },
      "Drop client " + r.lname + " (" + r.name + ", " + r.identity + ")? Its pending calls fail.");
    if (res) notice(res.ok ? "" : "Drop " + r.lname + " " + outcome(res));
  }
  function renderGroups(rows, total) {
    const q = $("#groups-filter").value.trim().toLowerCase();
    const shown = rows.filter((g) => !q || g.group.toLowerCase().includes(q) ||
      g.members.some((m) => (m.lname + " " + m.name).toLowerCase().includes(q)));
    $("#groups-count").textContent = "(" + shown.length + " of " + total + ")";
    syncRows($("#groups-table tbody"), shown, "data-group", (g) => g.group, (g) => [
      T(g.group), T(g.members.map((m) => m.lname + " " + m.name).join(", "), "wrap"),
    ], (g) => el("button", { type: "button", onclick: () => openCall(g.group) }, "Call…"));
  }
  function renderCommands(rows) {
    syncRows($("#commands-table tbody"), sorted("commands-table", rows), "data-key",
      (r) => r.group + "\u0000" + r.command, (r) => [
        T(r.group), T(r.command), T(num(r.requests), "num"), T(num(r.rate), "num"),
        T(num(r.failed), "num"),
        T(Object.entries(r.errors).map(([k, v]) => k + "=" + v).join(", ") || "–", "wrap"),
        T(latency(r.p50, false), "num"), T(latency(r.p99, r.p99_over), "num"),
      ]);
  }
  function renderQueues(d) {
    syncRows($("#queues-table tbody"), d.queues, "data-queue", (q) => q.queue, (q) => [
      T(q.queue), T(num(q.depth), "num"), T(num(q.in_flight), "num"), T(age(q.oldest_age), "num"),
      T(num(q.consumers), "num"), T(num(q.redelivered), "num"), T(num(q.dead_lettered), "num"),
    ], (q) => el("button", { type: "button", class: "danger", onclick: () => purge(q.queue) }, "Purge"));
    fill($("#pipes-table tbody"), d.pipes.map((p) => el("tr", {},
      el("td", {}, p.name), el("td", {}, p.node), el("td", {}, p.writers.join(", ")), el("td", {}, p.readers.join(", ")))));
    fill($("#links-table tbody"), d.links.map((l) => el("tr", {}, el("td", { class: "wrap" }, JSON.stringify(l)))));
  }
  async function purge(queue) {
    const res = await act({ action: "purge", queue }, "Purge queue " + queue + "? Every message in it is removed.");
    if (res) notice(res.ok ? "" : "Purge " + queue + " " + outcome(res));
  }
  function render() {
    if (!doc) return;
    const errs = Object.entries(doc.errors || {});
    const down = doc.errors && doc.errors.broker;
    $("#status").textContent = down ? "broker " + doc.errors.broker :
      errs.length ? "partial: " + errs.map(([k, v]) => k + " " + v).join("; ") : "live";
    $("#status").className = "status" + (down ? " down" : "");
    if (doc.taken_at) {
      const t = $("#updated");
      t.textContent = timeFmt.format(new Date(doc.taken_at * 1000));
      t.setAttribute("datetime", new Date(doc.taken_at * 1000).toISOString());
      t.dataset.takenAt = String(doc.taken_at);
    }
    if (doc.interval) $("#interval").textContent = num(doc.interval);
    if (!doc.broker) return;
    // Only the view on screen: with 1,000 clients, rebuilding every table each push
    // would cost the browser more than the one being looked at.
    const view = current();
    // A document taken before this view's stream opened may lack its section: the
    // table keeps what it shows until the snapshot that has it (pushed at once).
    const needs = { clients: "clients", groups: "clients", commands: "commands", queues: "queues" }[view];
    if (needs && doc.sections && !doc.sections.includes(needs)) return;
    if (view === "broker") { renderBroker(doc.broker); renderChart(doc.rates || []); }
    else if (view === "clients") renderClients(doc.clients, doc.clients_total);
    else if (view === "groups") renderGroups(doc.groups, doc.groups_total);
    else if (view === "commands") renderCommands(doc.commands);
    else if (view === "queues") renderQueues(doc);
  }
  function current() {
    const t = tabs.find((x) => x.getAttribute("aria-selected") === "true");
    return t ? t.getAttribute("href").slice(1) : "broker";
  }
  // -- live updates: one event stream; the browser reconnects it after a loss --------
  // The stream names the view on screen: the console asks the broker only for what the
  // open views show (the clients of a big bus only while someone looks at them).
  let es = null, esView = null;
  function received(d, seq) {
    // Marks for the page's own timing (performance.getEntriesByType("mark")).
    if (!doc) performance.mark("console-first-snapshot");
    doc = d;
    document.body.dataset.seq = seq;
    if (doc.console && doc.console.login) $("#logout").hidden = false;
    render();
    if (performance.getEntriesByName("console-first-render").length === 0) performance.mark("console-first-render");
  }
  function listen() {
    const view = current();
    if (es && esView === view) return;
    if (es) es.close();
    esView = view;
    es = new EventSource("/api/events?view=" + encodeURIComponent(view));
    es.addEventListener("snapshot", (ev) => received(JSON.parse(ev.data), ev.lastEventId));
    // A change to the previous document of this stream: the clients that changed or
    // left, the groups only if they changed; the rest as in a snapshot.
    es.addEventListener("delta", (ev) => {
      const d = JSON.parse(ev.data);
      const byName = new Map((doc && doc.clients || []).map((r) => [r.lname, r]));
      for (const l of d.clients_delta.gone) byName.delete(l);
      for (const r of d.clients_delta.set) byName.set(r.lname, r);
      delete d.clients_delta;
      d.clients = Array.from(byName.values()).sort((a, b) => a.n - b.n);
      if (!("groups" in d)) d.groups = doc ? doc.groups : [];
      for (const r of d.clients) r.connected_for = Math.max(d.clients_now - r.connected_at, 0);
      received(d, ev.lastEventId);
    });
    es.addEventListener("error", () => {
      $("#status").textContent = "console unreachable, retrying…";
      $("#status").className = "status down";
    });
  }
  route();
  $("#clients-filter").addEventListener("input", render);
  $("#groups-filter").addEventListener("input", render);

  // -- call form ----------------------------------------------------------------------
  let declared = {};  // command name -> declaration
  function openCall(target) {
    $("#call-target").value = target;
    location.hash = "#actions";
    loadDeclaration();
  }
  async function loadDeclaration() {
    const target = $("#call-target").value.trim();
    if (!target) return;
    declared = {};
    const resp = await fetch("/api/describe?target=" + encodeURIComponent(target), { credentials: "same-origin" });
    const body = await resp.json().catch(() => ({ error: String(resp.status) }));
    const list = $("#call-commands");
    if (!resp.ok) { show($("#call-result"), false, "declaration: " + body.error); return; }
    for (const g of body) for (const m of g.members) {
      for (const c of (m.description && m.description.commands) || []) declared[c.name] = declared[c.name] || c;
    }
    list.replaceChildren(...Object.keys(declared).sort().map((n) => el("option", { value: n })));
    const names = Object.keys(declared);
    $("#call-doc").textContent = names.length ? "Declared: " + names.sort().join(", ") : "No member declares its commands: use the raw params.";
    if (names.length === 1 && !$("#call-command").value) $("#call-command").value = names[0];
    buildFields();
  }
  function buildFields() {
    const fs = $("#call-fields");
    const c = declared[$("#call-command").value.trim()];
    const legend = el("legend", {}, "Declared parameters");
    if (!c) { fs.replaceChildren(legend, el("p", { class: "doc" }, "No declaration for this command: use the raw params.")); return; }
    $("#call-doc").textContent = c.doc || "";
    const fields = (c.params || []).map((p) => {
      const t = p.type || "any";
      const type = t === "bool" ? "checkbox" : (t === "int" || t === "float") ? "number" : "text";
      const input = el("input", { name: "p:" + p.name, type, "data-type": t, "aria-describedby": "" });
      if (type === "number" && t === "float") input.step = "any";
      if (p.required !== false && type !== "checkbox") input.required = true;
      if ("default" in p) {
        if (type === "checkbox") input.checked = !!p.default;
        else input.placeholder = JSON.stringify(p.default);
      }
      return el("label", {}, p.name + ": " + t + (p.required === false ? " (optional)" : ""), input);
    });
    fs.replaceChildren(legend, ...(fields.length ? fields : [el("p", { class: "doc" }, "No parameters.")]));
  }
  $("#call-load").addEventListener("click", loadDeclaration);
  $("#call-command").addEventListener("change", buildFields);
  $("#call-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const target = $("#call-target").value.trim(), command = $("#call-command").value.trim();
    let params = null;
    const raw = $("#call-raw").value.trim();
    try {
      if (raw) params = JSON.parse(raw);
      else {
        const inputs = $("#call-fields").querySelectorAll("input");
        if (inputs.length) params = {};
        for (const i of inputs) {
          const name = i.name.slice(2), t = i.dataset.type;
          if (i.type === "checkbox") { params[name] = i.checked; continue; }
          if (i.value === "") continue;
          if (t === "int") params[name] = parseInt(i.value, 10);
          else if (t === "float") params[name] = parseFloat(i.value);
          else if (t === "str") params[name] = i.value;
          else params[name] = JSON.parse(i.value);
        }
      }
    } catch (e) {
      show($("#call-result"), false, "params are not JSON: " + e.message);
      return;
    }
    const res = await act({ action: "call", target, command, params },
      "Call " + target + " " + command + " " + JSON.stringify(params) + "?");
    if (res) show($("#call-result"), res.ok, outcome(res));
  });

  // -- notify -------------------------------------------------------------------------
  $("#notify-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const f = ev.target;
    let params = null;
    try { if (f.params.value.trim()) params = JSON.parse(f.params.value); }
    catch (e) { show($("#notify-result"), false, "params are not JSON: " + e.message); return; }
    const res = await act({ action: "notify", group: f.group.value.trim(), event: f.event.value.trim(), params },
      "Notify " + f.group.value + " of " + f.event.value + "?");
    if (res) show($("#notify-result"), res.ok, res.ok ? "sent" : outcome(res));
  });

  // -- capture ------------------------------------------------------------------------
  const list = (s) => s.split(",").map((x) => x.trim()).filter(Boolean);
  $("#capture-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const f = ev.target, params = {};
    if (f.dir.value.trim()) params.dir = f.dir.value.trim();
    if (f.kinds.value.trim()) params.kinds = list(f.kinds.value);
    if (f.targets.value.trim()) params.targets = list(f.targets.value);
    const res = await act({ action: "capture-start", params }, "Start a capture " + JSON.stringify(params) + "?");
    if (res) notice(res.ok ? "" : "Capture " + outcome(res));
  });
  $("#capture-stop").addEventListener("click", async () => {
    const res = await act({ action: "capture-stop" }, "Stop the capture?");
    if (res) notice(res.ok ? "" : "Capture " + outcome(res));
  });

  // -- live traffic -------------------------------------------------------------------
  let traffic = null;
  const MAX_TRAFFIC_ROWS = 200;
  function stopTraffic() {
    if (traffic) traffic.close();
    traffic = null;
    $("#traffic-start").disabled = false;
    $("#traffic-stop").disabled = true;
  }
  $("#traffic-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    stopTraffic();
    const f = ev.target, q = new URLSearchParams();
    for (const k of ["kind", "sender", "target"]) for (const v of list(f[k].value)) q.append(k, v);
    if (f.body.checked) q.set("body", "json");
    traffic = new EventSource("/api/traffic?" + q.toString());
    $("#traffic-start").disabled = true;
    $("#traffic-stop").disabled = false;
    const tbody = $("#traffic-table tbody");
    traffic.addEventListener("traffic", (e) => {
      const d = JSON.parse(e.data);
      for (const r of d.records) {
        tbody.prepend(el("tr", {},
          el("td", { class: "num" }, r.ts ? timeFmt.format(new Date(r.ts * 1000)) : ""),
          el("td", {}, r.kind), el("td", {}, (r.sender || "") + (r.sender_name ? " " + r.sender_name : "")),
          el("td", {}, r.target || ""), el("td", {}, r.command || r.event || r.code || ""),
          el("td", { class: "num" }, bytes(r.size)),
          el("td", { class: "wrap" }, r.body_encoding ? JSON.stringify(r.body) : "")));
      }
      while (tbody.rows.length > MAX_TRAFFIC_ROWS) tbody.deleteRow(-1);
    });
    traffic.addEventListener("error", () => { notice("The traffic view ended (refused, or the console is gone)."); stopTraffic(); });
  });
  $("#traffic-stop").addEventListener("click", stopTraffic);

  // -- log out (logged-in viewers; the button shows with the first snapshot) -----------
  $("#logout").addEventListener("click", async () => {
    await fetch("/logout", { method: "POST", credentials: "same-origin", headers: { "X-CSRF-Token": csrf } });
    location.href = "/";
  });
})();

/* The live run page: poll the read-only API for what was committed since the last answer,
 * merge it into the run state and redraw (charts.js). No reload: a metric the run writes shows
 * within one poll interval (?poll_ms=, default 2000).
 *
 * Cursor: the id of the store's last committed batch. Each answer's series carry the step range
 * [lo, hi] they cover; the page replaces its points in that range, so no step is ever lost, and
 * steps a rollback rewrote are replaced in place. A long run arrives downsampled (first/min/max/
 * last per bucket, ?max_points=, default 2000 per series); zooming a chart (drag) asks for that
 * window, at full resolution once it is small enough, and every chart follows; a double-click
 * returns to the whole run. A `restart` or `run_resumed` event triggers one full re-read. Text
 * from the store is inserted with textContent only. */
(function () {
  "use strict";

  const params = new URLSearchParams(window.location.search);
  const key = params.get("key") || ".";
  const pollMs = Math.max(200, parseInt(params.get("poll_ms") || "2000", 10) || 2000);
  const maxPoints = Math.min(200000, Math.max(16,
    parseInt(params.get("max_points") || "1200", 10) || 1200));
  const PLAN_EVERY = 5; // polls between plan refreshes (the measured median moves slowly)
  const MAX_EVENT_ROWS = 200;
  const COMPACT_FACTOR = 3; // a series this many times max_points long is re-read downsampled

  let state, cursor, polls = 0, view = null, planBusy = false;
  const options = {smoothing: 0, logLoss: true};
  const status = {updates: 0, errors: 0, lastError: null, cursor: null, firstRenderMs: null,
                  fullReads: 0, windowReads: 0};
  window.trainpilot = {status: status, state: () => state, view: () => view,
                       options: options};

  function reset() {
    state = {run: null, series: {}, layers: {names: [], series: {}}, ranks: {},
             stragglers: {}, straggler_ratio: 1.2, forecast: null, events: [],
             plan: state ? state.plan : null, cluster: state ? state.cluster : null};
    cursor = null;
  }

  function naturalCompare(a, b) {
    return a.localeCompare(b, undefined, {numeric: true});
  }

  function lowerBound(arr, x) {  // first index with arr[i] >= x
    let lo = 0, hi = arr.length;
    while (lo < hi) { const mid = (lo + hi) >> 1; if (arr[mid] < x) lo = mid + 1; else hi = mid; }
    return lo;
  }

  // Replace the points of `target` in [s.lo, s.hi] with s's points (no spread operator:
  // `push(...a)` overflows the call stack past ~120K points).
  function replaceRange(target, s) {
    const steps = target.steps, values = target.values;
    const a = lowerBound(steps, s.lo);
    const b = lowerBound(steps, s.hi + 1);
    if (a === steps.length) {
      for (let i = 0; i < s.steps.length; i++) { steps.push(s.steps[i]); values.push(s.values[i]); }
    } else {
      target.steps = steps.slice(0, a).concat(s.steps, steps.slice(b));
      target.values = values.slice(0, a).concat(s.values, values.slice(b));
    }
    target.downsampled = Boolean(target.downsampled || s.downsampled);
  }

  function mergeSeries(target, incoming, incremental) {
    for (const [name, s] of Object.entries(incoming)) {
      if (!incremental || !target[name]) {
        target[name] = {steps: s.steps.slice(), values: s.values.slice(),
                        downsampled: s.downsampled};
      } else {
        replaceRange(target[name], s);
      }
    }
  }

  function merge(d) {
    state.run = d.run;
    mergeSeries(state.series, d.series, d.incremental);
    mergeSeries(state.layers.series, d.layers.series, d.incremental);
    state.layers.names = Object.keys(state.layers.series).sort(naturalCompare);
    for (const [rank, cols] of Object.entries(d.ranks)) {
      if (!state.ranks[rank]) state.ranks[rank] = {};
      mergeSeries(state.ranks[rank], cols, d.incremental);
    }
    state.stragglers = d.stragglers;
    state.straggler_ratio = d.straggler_ratio;
    state.forecast = d.forecast;
    for (const e of d.events) state.events.push(e);
    state.latest_step = d.latest_step;
    cursor = d.cursor;
  }

  function longest() {
    let n = 0;
    for (const s of Object.values(state.series)) n = Math.max(n, s.steps.length);
    return n;
  }

  function apiUrl(path, extra) {
    const q = new URLSearchParams(Object.assign({key: key}, extra || {}));
    return `${path}?${q.toString()}`;
  }

  async function getJson(url, started) {
    const resp = await (started || fetch(url, {credentials: "same-origin", cache: "no-store"}));
    if (!resp.ok) throw new Error(`${resp.status} ${(await resp.text()).slice(0, 200)}`);
    return resp.json();
  }

  async function poll() {
    const since = {max_points: maxPoints};
    if (cursor) {
      if (cursor.mode === "batch") since.since_batch = cursor.batch;
      else if (cursor.step !== null) since.since_step = cursor.step;
      if (cursor.event) since.since_event = cursor.event;
    }
    // The first read was started by prefetch.js while plotly.js was being parsed.
    const first = !cursor && window.trainpilotFirst;
    window.trainpilotFirst = null;
    const d = await getJson(apiUrl("/api/run", since), first || null);
    // A rollback or restart (restored step), or a re-run process (run_resumed) with nothing
    // to restore, rewrites steps: read everything again. So does a live tail grown long.
    const rewritten = d.events.some((e) => e.kind === "restart" || e.kind === "run_resumed");
    if (cursor && (rewritten || longest() > COMPACT_FACTOR * maxPoints)) {
      reset();
      return poll();
    }
    if (!d.incremental) status.fullReads += 1;
    merge(d);
    if (polls % PLAN_EVERY === 0 && !planBusy) refreshPlan();
    polls += 1;
  }

  // The plan panel (its measured median reads every step time) never delays the charts.
  async function refreshPlan() {
    planBusy = true;
    try {
      state.plan = await getJson(apiUrl("/api/plan"));
      renderPlan();
      state.cluster = await getJson(apiUrl("/api/cluster"));
      renderCluster();
    } catch (err) {
      status.lastError = String(err);
    } finally {
      planBusy = false;
    }
  }

  // ---------------------------------------------------------------- zoom (shared by all charts)
  let zoomSeq = 0;

  async function setView(lo, hi) {
    if (lo === null) {
      view = null;
      draw();
      return;
    }
    const seq = ++zoomSeq;
    const w = await getJson(apiUrl("/api/window", {lo: Math.floor(lo), hi: Math.ceil(hi),
                                                   max_points: maxPoints}));
    if (seq !== zoomSeq) return; // a newer zoom won
    status.windowReads += 1;
    view = {lo: lo, hi: hi, data: w};
    draw();
  }

  function onRelayout(ev) {
    if (!ev) return;
    if (ev["xaxis.autorange"]) { setView(null, null); return; }
    const lo = ev["xaxis.range[0]"], hi = ev["xaxis.range[1]"];
    const range = ev["xaxis.range"];
    if (lo !== undefined && hi !== undefined) setView(lo, hi);
    else if (range) setView(range[0], range[1]);
  }

  function drawnState() {
    if (!view) return state;
    return Object.assign({}, state, {series: view.data.series, layers: view.data.layers,
                                     ranks: view.data.ranks});
  }

  const hooked = new Set();

  function draw() {
    window.TP.render(drawnState(), {view: view ? {lo: view.lo, hi: view.hi} : null,
                                    smoothing: options.smoothing, logLoss: options.logLoss});
    for (const id of Object.keys(window.TP.figures)) {
      const el = document.getElementById(id);
      if (el && !hooked.has(id) && el.on) {
        el.on("plotly_relayout", onRelayout);
        hooked.add(id);
      }
    }
  }

  function setupToolbar() {
    const smoothing = document.getElementById("smoothing");
    const smoothingValue = document.getElementById("smoothing-value");
    const logLoss = document.getElementById("log-loss");
    const csv = document.getElementById("csv-link");
    if (smoothing) {
      smoothing.addEventListener("input", () => {
        options.smoothing = Math.min(0.99, Math.max(0, parseFloat(smoothing.value) || 0));
        smoothingValue.textContent = options.smoothing.toFixed(2);
        if (state) draw();
      });
    }
    if (logLoss) {
      logLoss.addEventListener("change", () => {
        options.logLoss = logLoss.checked;
        if (state) draw();
      });
    }
    if (csv) {
      csv.href = apiUrl("/api/csv", {metric: "loss"});
    }
  }

  function updateCsvLink() {
    const csv = document.getElementById("csv-link");
    if (!csv) return;
    const names = Object.keys(state.series);
    const q = new URLSearchParams([["key", key], ...names.map((n) => ["metric", n])]);
    csv.href = `/api/csv?${q.toString()}`;
  }

  function fmt(v, digits) {
    if (v === null || v === undefined) return "-";
    if (typeof v !== "number") return String(v);
    return Math.abs(v) >= 1e5 || (Math.abs(v) < 1e-3 && v !== 0)
      ? v.toExponential(digits || 3) : v.toPrecision(digits || 4);
  }

  function setText(id, text) {
    document.getElementById(id).textContent = text;
  }

  function renderHeader() {
    const run = state.run || {};
    setText("run-name", run.name || key);
    const badge = document.getElementById("run-status");
    badge.textContent = run.status || "unknown";
    badge.className = `badge ${run.status || "unknown"}`;
    const step = state.latest_step;
    setText("run-step", step === null || step === undefined ? "-" : String(step));
    const note = document.getElementById("resolution-note");
    if (note) {
      const down = Object.values(state.series).some((s) => s.downsampled);
      const zoomed = view && Object.values(view.data.series).some((s) => s.downsampled);
      note.textContent = view
        ? `steps ${Math.round(view.lo)}-${Math.round(view.hi)}` +
          (zoomed ? " (downsampled: zoom in further for every step)" : " (every step)") +
          "; double-click a chart for the whole run"
        : down ? `whole run, downsampled to ~${maxPoints} points per series (first, min, ` +
                 "max, last per bucket); drag on a chart to zoom" : "every step";
    }
    setText("run-loss", fmt(window.TP.latest(state, "loss")));
    const health = window.TP.latest(state, "health/score");
    const band = health === null ? "" : health >= 90 ? "healthy" : health >= 80 ? "watch"
      : health >= 60 ? "act" : "failing";  // trainpilot.health.score.BANDS
    setText("run-health", health === null ? "-" : `${health.toFixed(0)} / 100 (${band})`);
    setText("run-ranks", run.world_size ? String(run.world_size) : "-");
    setText("run-updated", new Date().toLocaleTimeString());
    document.title = `${run.name || key} - trainpilot`;
  }

  function renderPlan() {
    const p = state.plan;
    const body = document.querySelector("#plan-table tbody");
    if (!p) return;
    const rows = [];
    const layout = Object.entries(p.layout || {}).map(([k, v]) => `${k}=${v}`).join(" ");
    rows.push(["layout", layout || "not recorded"]);
    if (p.model) rows.push(["model", p.model.name || JSON.stringify(p.model)]);
    if (p.cluster) rows.push(["cluster", p.cluster.name || JSON.stringify(p.cluster)]);
    rows.push(["predicted step time", p.predicted_step_time_s
      ? `${(p.predicted_step_time_s * 1e3).toFixed(2)} ms (${p.prediction_source})`
      : p.prediction_source || "not available"]);
    rows.push(["measured step time (median)", p.measured_step_time_s
      ? `${(p.measured_step_time_s * 1e3).toFixed(2)} ms over ${p.num_steps_measured} steps`
      : "not available"]);
    if (p.measured_over_predicted) {
      rows.push(["measured / predicted", `${p.measured_over_predicted.toFixed(3)} ` +
                 `(prediction error ${p.error_pct.toFixed(1)}%)`]);
    }
    body.replaceChildren(...rows.map(([k, v]) => {
      const tr = document.createElement("tr");
      const th = document.createElement("th");
      const td = document.createElement("td");
      th.textContent = k;
      td.textContent = v;
      tr.append(th, td);
      return tr;
    }));
  }

  // The cluster panel: shown for a run on more than one host (trainpilot.ui.cluster).
  function renderCluster() {
    const c = state.cluster;
    const panel = document.getElementById("cluster-panel");
    if (!c || !c.hosts || !c.hosts.length) {
      panel.hidden = true;
      return;
    }
    panel.hidden = false;
    const mbit = (v) => (v === null || v === undefined ? "-" : v.toFixed(0));
    fillRows("#cluster-hosts tbody", c.hosts.map((h) => [
      h.host, h.state, h.launches, mbit(h.link_mbit_s) + (h.link_slow ? " (slow)" : ""),
      h.flagged_rounds, h.probe_live ? (h.address || "live") : "-"]),
    (tr, i) => { if (c.hosts[i].link_slow || c.hosts[i].state === "drained") tr.className = "sev-warning"; });
    fillRows("#cluster-links tbody", c.links.map((l) => [
      `${l.a} - ${l.b}`, mbit(l.mbit_s), l.probes, l.failed, (l.probe_bytes / 1e6).toFixed(1)]));
    fillRows("#cluster-events tbody", c.events.map((e) => [
      e.unix_s ? new Date(e.unix_s * 1000).toLocaleTimeString() : "-",
      e.step === null || e.step === undefined ? "-" : e.step, e.kind, e.host || "-", e.message]));
  }

  function fillRows(selector, rows, decorate) {
    const body = document.querySelector(selector);
    body.replaceChildren(...rows.map((cells, i) => {
      const tr = document.createElement("tr");
      for (const v of cells) {
        const td = document.createElement("td");
        td.textContent = String(v);
        tr.append(td);
      }
      if (decorate) decorate(tr, i);
      return tr;
    }));
  }

  function renderEvents() {
    const body = document.querySelector("#events-table tbody");
    const recent = state.events.slice(-MAX_EVENT_ROWS).reverse();
    body.replaceChildren(...recent.map((e) => {
      const tr = document.createElement("tr");
      tr.className = `sev-${e.severity}`;
      for (const v of [e.step === null ? "-" : e.step, e.kind, e.severity, e.name, e.message]) {
        const td = document.createElement("td");
        td.textContent = String(v);
        tr.append(td);
      }
      return tr;
    }));
  }

  async function tick() {
    const dot = document.getElementById("live-dot");
    try {
      await poll();
      draw();
      renderHeader();
      renderPlan();
      renderEvents();
      updateCsvLink();
      status.updates += 1;
      if (status.firstRenderMs === null) status.firstRenderMs = performance.now();
      status.cursor = Object.assign({}, cursor);
      dot.className = "dot ok";
      dot.title = `updated every ${pollMs} ms`;
    } catch (err) {
      status.errors += 1;
      status.lastError = String(err);
      dot.className = "dot err";
      dot.title = String(err);
    }
    window.setTimeout(tick, pollMs);
  }

  setupToolbar();
  reset();
  tick();
})();

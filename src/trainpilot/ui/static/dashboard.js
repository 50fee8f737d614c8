/* The live run page: poll the read-only API for what was committed since the last answer,
 * merge it into the run state and redraw (charts.js). No reload: a metric the run writes shows
 * within one poll interval (?poll_ms=, default 2000). A `restart` event (a rollback rewrote
 * steps behind the cursor) triggers one full re-read. Text from the store is inserted with
 * textContent only. */
(function () {
  "use strict";

  const params = new URLSearchParams(window.location.search);
  const key = params.get("key") || ".";
  const pollMs = Math.max(200, parseInt(params.get("poll_ms") || "2000", 10) || 2000);
  const PLAN_EVERY = 5; // polls between plan refreshes (the measured median moves slowly)
  const MAX_EVENT_ROWS = 200;

  let state, cursor, polls = 0;
  const status = {updates: 0, errors: 0, lastError: null, cursor: null};
  window.trainpilot = {status: status, state: () => state};

  function reset() {
    state = {run: null, series: {}, layers: {names: [], series: {}},
             ranks: {step: [], rank: [], step_s: [], compute_s: [], comm_s: [], data_s: [],
                     tokens_per_s: []},
             stragglers: {}, straggler_ratio: 1.2, forecast: null, events: [], plan: null};
    cursor = {step: null, rank_step: null, event: 0};
  }

  function naturalCompare(a, b) {
    return a.localeCompare(b, undefined, {numeric: true});
  }

  function appendSeries(target, incoming) {
    for (const [name, s] of Object.entries(incoming)) {
      if (!target[name]) target[name] = {steps: [], values: []};
      target[name].steps.push(...s.steps);
      target[name].values.push(...s.values);
    }
  }

  function merge(d) {
    state.run = d.run;
    appendSeries(state.series, d.series);
    appendSeries(state.layers.series, d.layers.series);
    state.layers.names = Object.keys(state.layers.series).sort(naturalCompare);
    for (const col of Object.keys(state.ranks)) state.ranks[col].push(...(d.ranks[col] || []));
    state.stragglers = d.stragglers;
    state.straggler_ratio = d.straggler_ratio;
    state.forecast = d.forecast;
    state.events.push(...d.events);
    cursor = d.cursor;
  }

  function apiUrl(path, extra) {
    const q = new URLSearchParams(Object.assign({key: key}, extra || {}));
    return `${path}?${q.toString()}`;
  }

  async function getJson(url) {
    const resp = await fetch(url, {credentials: "same-origin", cache: "no-store"});
    if (!resp.ok) throw new Error(`${resp.status} ${(await resp.text()).slice(0, 200)}`);
    return resp.json();
  }

  async function poll() {
    const since = {};
    if (cursor.step !== null) since.since_step = cursor.step;
    if (cursor.rank_step !== null) since.since_rank_step = cursor.rank_step;
    if (cursor.event) since.since_event = cursor.event;
    const d = await getJson(apiUrl("/api/run", since));
    // A rollback or restart (restored step), or a re-run process (run_resumed) with nothing
    // to restore, rewrites steps behind the cursor: read everything again.
    if (cursor.event && d.events.some((e) => e.kind === "restart" || e.kind === "run_resumed")) {
      reset();
      return poll();
    }
    merge(d);
    if (polls % PLAN_EVERY === 0) state.plan = await getJson(apiUrl("/api/plan"));
    polls += 1;
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
    setText("run-step", cursor.step === null ? "-" : String(cursor.step));
    setText("run-loss", fmt(window.TP.latest(state, "loss")));
    const health = window.TP.latest(state, "health/score");
    setText("run-health", health === null ? "-" : `${health.toFixed(0)} / 100`);
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
      window.TP.render(state);
      renderHeader();
      renderPlan();
      renderEvents();
      status.updates += 1;
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

  reset();
  tick();
})();

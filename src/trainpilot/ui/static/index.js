/* The runs index: every run under the dashboard's directory with its status (refreshed every
 * few seconds), and the loss curves of the ticked runs on one chart. */
(function () {
  "use strict";

  const REFRESH_MS = 5000;
  const selected = new Set();
  window.trainpilot = {runs: [], compared: []};

  async function getJson(url) {
    const resp = await fetch(url, {credentials: "same-origin", cache: "no-store"});
    if (!resp.ok) throw new Error(`${resp.status}`);
    return resp.json();
  }

  function cell(text) {
    const td = document.createElement("td");
    td.textContent = text === null || text === undefined ? "-" : String(text);
    return td;
  }

  function renderRuns(data) {
    document.getElementById("root-name").textContent = data.root;
    window.trainpilot.runs = data.runs;
    const body = document.querySelector("#runs-table tbody");
    body.replaceChildren(...data.runs.map((r) => {
      const tr = document.createElement("tr");
      const box = document.createElement("input");
      box.type = "checkbox";
      box.value = r.key;
      box.checked = selected.has(r.key);
      box.addEventListener("change", () => {
        if (box.checked) selected.add(r.key); else selected.delete(r.key);
      });
      const tick = document.createElement("td");
      tick.append(box);
      const link = document.createElement("a");
      link.href = `/run?key=${encodeURIComponent(r.key)}`;
      link.textContent = r.key;
      const name = document.createElement("td");
      name.append(link);
      const status = cell(r.status);
      status.className = `badge ${r.status}`;
      if (r.error) status.title = r.error;  // a broken store says why
      const started = r.started_time ? new Date(r.started_time * 1000).toLocaleString() : null;
      tr.append(tick, name, cell(r.name), status, cell(r.world_size), cell(r.step),
                cell(r.loss === null ? null : r.loss.toPrecision(4)),
                cell(r.health === null ? null : r.health.toFixed(0)), cell(started),
                cell(r.error));
      return tr;
    }));
  }

  async function compare() {
    const keys = [...selected];
    const note = document.getElementById("compare-note");
    if (keys.length < 1) {
      note.textContent = "tick at least one run";
      return;
    }
    const q = new URLSearchParams(keys.map((k) => ["key", k]));
    const data = await getJson(`/api/compare?${q.toString()}`);
    const traces = Object.entries(data.runs).map(([k, r]) => ({
      type: "scatter", mode: "lines", x: r.steps, y: r.values,
      name: `${k} (${r.status})${r.downsampled ? ", downsampled" : ""}`}));
    window.trainpilot.compared = keys;
    note.textContent = `${keys.length} run(s)`;
    window.Plotly.react("compare-chart", traces, {
      title: {text: "Loss of the selected runs", x: 0.01, font: {size: 14}}, height: 420,
      xaxis: {title: {text: "step"}}, yaxis: {title: {text: "loss"}, type: "log"},
      margin: {l: 62, r: 24, t: 34, b: 40}, legend: {orientation: "h", y: -0.18}},
      {displaylogo: false, responsive: true});
  }

  async function refresh() {
    try {
      renderRuns(await getJson("/api/runs"));
    } finally {
      window.setTimeout(refresh, REFRESH_MS);
    }
  }

  document.getElementById("compare-button").addEventListener("click", compare);
  refresh();
})();

/* Figures of a run, shared by the live dashboard (run.html) and the HTML report.
 *
 * Input: the run state, shaped as trainpilot.ui.data.run_data answers (merged across polls):
 *   {run, series: {name: {steps, values}}, layers: {names, series}, ranks: {rank: {step_s,
 *    compute_s, comm_s, data_s, tokens_per_s: {steps, values}}}, stragglers: {rank: ratio},
 *    straggler_ratio, forecast, events}
 * Options (TP.render(state, options)): view {lo, hi} (a zoomed step range shared by every chart,
 * null: the whole run), smoothing (0-0.99: an exponential moving average of the loss drawn over
 * it, TensorBoard's debiased form), logLoss (log or linear loss axis).
 * Output: every chart whose <div id> is on the page, drawn with Plotly.react. Values are drawn
 * as the store holds them (a long run's series arrive downsampled: first/min/max/last per
 * bucket, so extremes stay); null (NaN in the store) is a gap.
 */
(function (root) {
  "use strict";

  const PALETTE = ["#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf",
                   "#bcbd22", "#7f7f7f"];
  const STRAGGLER_COLOR = "#d62728";
  const SEVERITY_COLOR = {info: "#6c757d", warning: "#e0a100", critical: "#d62728"};
  const KIND_SYMBOL = {alert: "triangle-up", intervention: "diamond", fault: "x",
                       restart: "star", checkpoint: "square", diagnosis: "cross",
                       lr_change: "triangle-down", run_start: "circle",
                       run_resumed: "circle-cross", run_end: "circle-open", note: "circle-dot"};
  const TIMELINE_ORDER = ["run_start", "run_resumed", "checkpoint", "lr_change", "alert",
                          "intervention", "fault", "diagnosis", "restart", "run_end", "note"];
  const PARTS = ["gradient_flow", "communication", "hardware", "convergence"];
  const PART_COLORS = ["#4c78a8", "#72b7b2", "#f58518", "#54a24b"];

  let OPTIONS = {};

  function stepAxis(extra) {
    const view = OPTIONS.view;
    const axis = {zeroline: false, hoverformat: "d", title: {text: "step", standoff: 4}};
    if (view) { axis.range = [view.lo, view.hi]; axis.autorange = false; } else {
      axis.autorange = true;
    }
    return Object.assign(axis, extra || {});
  }

  function layout(title, extra) {
    const view = OPTIONS.view;
    const out = Object.assign({
      title: {text: title, font: {size: 14}, x: 0.01},
      margin: {l: 62, r: 24, t: 34, b: 44},
      height: 320,
      // A new revision whenever the shared view changes, so the range below is applied;
      // between changes the user's own pan/zoom state is kept.
      uirevision: view ? `view-${view.lo}-${view.hi}` : "all",
      xaxis: stepAxis(),
      legend: {orientation: "h", y: -0.12, yanchor: "top", font: {size: 11}},
      font: {family: "system-ui, -apple-system, Segoe UI, sans-serif", size: 12},
      paper_bgcolor: "rgba(0,0,0,0)",
    }, extra || {});
    if (extra && extra.xaxis) out.xaxis = Object.assign(stepAxis(), extra.xaxis);
    return out;
  }

  // TensorBoard's smoothing: an exponential moving average, debiased at the start, skipping
  // gaps (a null stays a null and does not enter the average).
  function smooth(values, weight) {
    const out = new Array(values.length);
    let last = 0, num = 0;
    for (let i = 0; i < values.length; i++) {
      const v = values[i];
      if (v === null || !isFinite(v)) { out[i] = null; continue; }
      last = last * weight + (1 - weight) * v;
      num += 1;
      out[i] = last / (1 - Math.pow(weight, num));
    }
    return out;
  }

  function empty(title, why) {
    return {data: [], layout: layout(title, {
      xaxis: {visible: false}, yaxis: {visible: false},
      annotations: [{text: why, showarrow: false, xref: "paper", yref: "paper", x: 0.5,
                     y: 0.5, font: {color: "#6c757d"}}]})};
  }

  function series(state, name) {
    return (state.series || {})[name] || null;
  }

  function has(state, name) {
    const s = series(state, name);
    return s !== null && s.steps.length > 0;
  }

  function line(s, name, extra) {
    return Object.assign({type: "scatter", mode: "lines", x: s.steps, y: s.values, name: name},
                         extra || {});
  }

  function byRank(state, key) {
    const r = state.ranks || {};
    const out = new Map();
    for (const rank of Object.keys(r).map(Number).sort((a, b) => a - b)) {
      const s = (r[String(rank)] || {})[key];
      if (s && s.steps.length) out.set(rank, s);
    }
    return out;
  }

  function stragglerRatio(state, rank) {
    const ratio = (state.stragglers || {})[String(rank)];
    return ratio === undefined ? null : ratio;
  }

  function isStraggler(state, rank) {
    const ratio = stragglerRatio(state, rank);
    return ratio !== null && ratio >= (state.straggler_ratio || 1.2);
  }

  function rankStyle(state, rank, dash) {
    const slow = isStraggler(state, rank);
    return {color: slow ? STRAGGLER_COLOR : PALETTE[rank % PALETTE.length],
            width: slow ? 3 : 1.5, dash: dash || "solid"};
  }

  function rankName(state, rank, what) {
    const ratio = stragglerRatio(state, rank);
    const tag = isStraggler(state, rank) ? ` (straggler ${ratio.toFixed(2)}x)` : "";
    return `rank ${rank} ${what}${tag}`;
  }

  // ---------------------------------------------------------------- the panels
  function lossFigure(state) {
    const title = "Loss and convergence forecast";
    if (!has(state, "loss")) return empty(title, "no loss recorded yet");
    const loss = series(state, "loss");
    const weight = OPTIONS.smoothing || 0;
    const data = [];
    if (weight > 0) {
      data.push(line(loss, "loss (raw)", {line: {color: "#1f77b4", width: 1}, opacity: 0.3}));
      data.push({type: "scatter", mode: "lines", x: loss.steps, y: smooth(loss.values, weight),
                 name: `loss (smoothed ${weight})`, line: {color: "#1f77b4", width: 2}});
    } else {
      data.push(line(loss, "loss", {line: {color: "#1f77b4"}}));
    }
    if (has(state, "loss_trend")) {
      data.push(line(series(state, "loss_trend"), "trend (robust)",
                     {line: {color: "#7f7f7f", dash: "dot", width: 1}}));
    }
    const fc = state.forecast;
    if (fc && fc.band && fc.band.length) {
      const x = fc.band.map((b) => b[0]);
      data.push({type: "scatter", mode: "lines", x: x, y: fc.band.map((b) => b[1]),
                 line: {width: 0}, showlegend: false, hoverinfo: "skip", name: "forecast lo"});
      data.push({type: "scatter", mode: "lines", x: x, y: fc.band.map((b) => b[3]),
                 fill: "tonexty", fillcolor: "rgba(255,127,14,0.18)", line: {width: 0},
                 name: `forecast ${Math.round((fc.interval || 0.8) * 100)}% band`});
      data.push({type: "scatter", mode: "lines", x: x, y: fc.band.map((b) => b[2]),
                 line: {color: "#ff7f0e", dash: "dash"}, name: "forecast"});
    }
    if (fc && fc.final_loss !== null && fc.final_loss !== undefined) {
      data.push({type: "scatter", mode: "markers", x: [fc.total_steps], y: [fc.final_loss],
                 marker: {color: "#ff7f0e", size: 9, symbol: "diamond"},
                 error_y: {type: "data", symmetric: false, array: [fc.final_hi - fc.final_loss],
                           arrayminus: [fc.final_loss - fc.final_lo], color: "#ff7f0e"},
                 name: `final loss forecast (made at step ${fc.made_at_step})`});
    }
    const type = OPTIONS.logLoss === false ? "linear" : "log";
    return {data: data, layout: layout(title, {yaxis: {title: {text: "loss"},
                                                        type: type}})};
  }

  function lrFigure(state) {
    const title = "Learning rate";
    if (!has(state, "lr")) return empty(title, "no learning rate recorded");
    return {data: [line(series(state, "lr"), "lr", {line: {color: "#9467bd"}})],
            layout: layout(title, {yaxis: {title: {text: "learning rate"}, exponentformat: "e"},
                                   showlegend: false})};
  }

  function heatmapFigure(state) {
    const title = "Gradient norm per layer";
    const layers = state.layers || {names: [], series: {}};
    if (!layers.names.length) return empty(title, "no per-layer gradient norms recorded");
    const stepSet = new Set();
    for (const name of layers.names) for (const s of layers.series[name].steps) stepSet.add(s);
    const steps = [...stepSet].sort((a, b) => a - b);
    const column = new Map(steps.map((s, i) => [s, i]));
    const z = [], raw = [];
    for (const name of layers.names) {
      const logRow = new Array(steps.length).fill(null);
      const rawRow = new Array(steps.length).fill(null);
      const s = layers.series[name];
      for (let i = 0; i < s.steps.length; i++) {
        const v = s.values[i];
        const j = column.get(s.steps[i]);
        rawRow[j] = v;
        logRow[j] = v !== null && v > 0 ? Math.log10(v) : null;
      }
      z.push(logRow);
      raw.push(rawRow);
    }
    return {data: [{type: "heatmap", x: steps, y: layers.names, z: z, customdata: raw,
                    colorscale: "Viridis", colorbar: {title: {text: "log10 |g|"}},
                    hovertemplate: "%{y}<br>step %{x}<br>|g| = %{customdata:.4g}<extra></extra>",
                    name: "grad norm"}],
            layout: layout(title, {yaxis: {automargin: true, type: "category"},
                                   height: Math.max(300, 26 * layers.names.length + 90)})};
  }

  function rankStepFigure(state) {
    const title = "Time per rank: compute before the collective (solid), whole step (dotted)";
    const compute = byRank(state, "compute_s");
    if (!compute.size) {
      if (!has(state, "step_time_s")) return empty(title, "no step times recorded");
      return {data: [line(series(state, "step_time_s"), "step time")],
              layout: layout("Step time (no per-rank timings recorded)",
                             {yaxis: {title: {text: "seconds"}}})};
    }
    const total = byRank(state, "step_s");
    const data = [];
    for (const [rank, s] of compute) {
      data.push(line(s, rankName(state, rank, "compute"),
                     {line: rankStyle(state, rank), legendgroup: `r${rank}`}));
      if (total.has(rank)) {
        data.push(line(total.get(rank), `rank ${rank} step`,
                       {line: rankStyle(state, rank, "dot"), legendgroup: `r${rank}`,
                        opacity: 0.6}));
      }
    }
    // Log scale: one stalled step (a GC pause, a busy host) must not flatten all the others.
    return {data: data, layout: layout(title, {yaxis: {title: {text: "seconds (log)"},
                                                       type: "log"}})};
  }

  function rankTokensFigure(state) {
    const title = "Tokens/s per rank";
    const perRank = byRank(state, "tokens_per_s");
    const any = [...perRank.values()].some((s) => s.values.some((v) => v !== null));
    if (!any) {
      if (!has(state, "tokens_per_s")) return empty(title, "no throughput recorded");
      return {data: [line(series(state, "tokens_per_s"), "tokens/s (all ranks)")],
              layout: layout("Tokens/s (no per-rank timings recorded)",
                             {yaxis: {title: {text: "tokens/s"}}})};
    }
    const data = [];
    for (const [rank, s] of perRank) {
      data.push(line(s, rankName(state, rank, ""), {line: rankStyle(state, rank)}));
    }
    if (has(state, "tokens_per_s")) {
      data.push(line(series(state, "tokens_per_s"), "whole job",
                     {line: {color: "#444", dash: "dash", width: 1}, yaxis: "y2"}));
    }
    return {data: data, layout: layout(title, {
      margin: {l: 62, r: 64, t: 34, b: 30},
      yaxis: {title: {text: "tokens/s per rank"}},
      yaxis2: {title: {text: "tokens/s, job"}, overlaying: "y", side: "right",
               tickmode: "auto", rangemode: "tozero", showgrid: false}})};
  }

  function commFigure(state) {
    const title = "Communication time";
    const perRank = byRank(state, "comm_s");
    const data = [];
    if (has(state, "comm_time_s")) {
      data.push(line(series(state, "comm_time_s"), "exposed comm (rank 0)",
                     {line: {color: "#17becf", width: 2}}));
    }
    if (has(state, "comm_max_s")) {
      data.push(line(series(state, "comm_max_s"), "longest collective",
                     {line: {color: "#8c564b", dash: "dot", width: 1}}));
    }
    for (const [rank, s] of perRank) {
      if (s.values.some((v) => v !== null)) {
        data.push(line(s, rankName(state, rank, "comm"),
                       {line: rankStyle(state, rank, "dash"), opacity: 0.7}));
      }
    }
    if (!data.length) return empty(title, "no communication time recorded");
    return {data: data, layout: layout(title, {yaxis: {title: {text: "seconds (log)"},
                                                       type: "log"}})};
  }

  function memoryFigure(state) {
    const title = "Memory";
    const data = [];
    if (has(state, "peak_mem_gib")) {
      data.push(line(series(state, "peak_mem_gib"), "peak memory (GiB)",
                     {mode: "lines+markers", line: {color: "#e377c2"}}));
    }
    if (has(state, "mem_frac")) {
      const s = series(state, "mem_frac");
      data.push({type: "scatter", mode: "lines", x: s.steps, name: "used / capacity (%)",
                 y: s.values.map((v) => (v === null ? null : 100 * v)), yaxis: "y2",
                 line: {color: "#7f7f7f", dash: "dot"}});
    }
    if (!data.length) return empty(title, "no memory recorded");
    return {data: data, layout: layout(title, {
      margin: {l: 62, r: 56, t: 34, b: 30},
      yaxis: {title: {text: "GiB"}, rangemode: "tozero"},
      yaxis2: {title: {text: "%"}, overlaying: "y", side: "right", range: [0, 100],
               tickmode: "linear", tick0: 0, dtick: 25, showgrid: false}})};
  }

  function healthFigure(state) {
    const title = "Health score and its four parts (25 points each)";
    if (!has(state, "health/score")) return empty(title, "no health score recorded");
    const data = [];
    PARTS.forEach((part, i) => {
      const s = series(state, `health/${part}`);
      if (!s) return;
      data.push({type: "scatter", mode: "lines", stackgroup: "parts", x: s.steps,
                 y: s.values.map((v) => (v === null ? null : 25 * v)), name: part,
                 line: {width: 0.5, color: PART_COLORS[i]}});
    });
    data.push(line(series(state, "health/score"), "score",
                   {line: {color: "#222", width: 2}}));
    return {data: data, layout: layout(title, {yaxis: {title: {text: "points"},
                                                        range: [0, 102]}})};
  }

  function timelineFigure(state) {
    const title = "Timeline: alerts, interventions, checkpoints, faults, restarts";
    // Events without a step are placed by their time (x_step, from the server); those that
    // cannot be placed are listed in the table only, never drawn at step 0.
    const events = (state.events || []).filter(
      (e) => e.kind !== "alert_cleared" && e.x_step !== null && e.x_step !== undefined);
    if (!events.length) return empty(title, "no events recorded");
    const kinds = [...new Set(events.map((e) => e.kind))].sort(
      (a, b) => rank(a) - rank(b));
    function rank(kind) {
      const i = TIMELINE_ORDER.indexOf(kind);
      return i < 0 ? TIMELINE_ORDER.length : i;
    }
    const data = kinds.map((kind) => {
      const mine = events.filter((e) => e.kind === kind);
      return {type: "scatter", mode: "markers", name: kind, y: mine.map(() => kind),
              x: mine.map((e) => e.x_step),
              text: mine.map((e) => `${e.name ? e.name + ": " : ""}${e.message || ""}` +
                             (e.placed_by_time ? " (no step recorded: placed by its time)" : "")),
              hovertemplate: "step %{x}<br>%{text}<extra>" + kind + "</extra>",
              marker: {size: 11, symbol: KIND_SYMBOL[kind] || "circle",
                       color: mine.map((e) => SEVERITY_COLOR[e.severity] || "#6c757d"),
                       line: {width: 1, color: "#333"}}};
    });
    return {data: data, layout: layout(title, {
      yaxis: {type: "category", categoryarray: kinds, automargin: true},
      height: Math.max(220, 36 * kinds.length + 110), showlegend: false})};
  }

  const FIGURES = {
    "loss-chart": lossFigure, "lr-chart": lrFigure, "grad-heatmap": heatmapFigure,
    "rank-step-chart": rankStepFigure, "rank-tokens-chart": rankTokensFigure,
    "comm-chart": commFigure, "mem-chart": memoryFigure, "health-chart": healthFigure,
    "timeline-chart": timelineFigure,
  };
  // No mode bar: it covers the titles; drag zooms, double-click resets.
  const CONFIG = {displaylogo: false, responsive: true, displayModeBar: false};

  let revision = 0;

  function render(state, options) {
    OPTIONS = options || {};
    const config = Object.assign({}, CONFIG, OPTIONS.config || {});
    // The traces share the state's arrays, which polls extend in place; Plotly.react redraws
    // mutated arrays only when datarevision changes.
    revision += 1;
    for (const [id, build] of Object.entries(FIGURES)) {
      const el = document.getElementById(id);
      if (!el) continue;
      const fig = build(state);
      fig.layout.datarevision = revision;
      root.Plotly.react(el, fig.data, fig.layout, config);
    }
  }

  function latest(state, name) {
    const s = series(state, name);
    if (!s) return null;
    for (let i = s.values.length - 1; i >= 0; i--) if (s.values[i] !== null) return s.values[i];
    return null;
  }

  root.TP = {render: render, figures: FIGURES, latest: latest, isStraggler: isStraggler,
             smooth: smooth};
})(window);

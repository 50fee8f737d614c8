/* Starts the run page's first /api/run request before plotly.js (4.8 MB) is parsed, so the
 * server reads the store while the browser compiles the library; dashboard.js takes the
 * answer from window.trainpilotFirst. The same URL parameters as dashboard.js. */
(function () {
  "use strict";
  const params = new URLSearchParams(window.location.search);
  const maxPoints = Math.min(200000, Math.max(16,
    parseInt(params.get("max_points") || "1200", 10) || 1200));
  const q = new URLSearchParams({key: params.get("key") || ".", max_points: maxPoints});
  window.trainpilotFirst = fetch(`/api/run?${q.toString()}`,
                                 {credentials: "same-origin", cache: "no-store"});
})();

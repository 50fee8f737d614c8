"""Looking at runs: the dashboard (a local web page over a read-only JSON API) and the
self-contained HTML report. Both read a run's store (``trainpilot.store``) read-only, while
training writes it. See docs/dashboard.md.

- ``runs``: find run directories under a root, open their stores read-only.
- ``data``: the JSON the page and the report draw (series, per-rank timings, events, forecast).
- ``plan``, ``goodput``: predicted vs measured step time; goodput measured vs simulated.
- ``server``: the Starlette app (static files + read-only API, token, host checks).
- ``report``: the HTML report (plotly inlined) and its PDF (headless Chromium).
"""

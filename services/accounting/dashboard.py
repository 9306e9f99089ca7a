"""The finance dashboard at `GET /dashboard`: one static page (static/dashboard.html, .js, .css) that draws the
finance API's own reports (/v1/reports/cost and /v1/reports/goodput) as charts: cost per day (list vs measured),
cost per 1 M output tokens by model, SLA attainment and goodput over time, top tenants by cost.

Vendored: Chart.js 4.6.1 (MIT; https://www.chartjs.org), static/chart.umd.js is the npm package's
dist/chart.umd.js unchanged (`npm pack chart.js@4.6.1`; sha256 338399fb5bafe598d21cfc471b0590b61ceb321a985fade4f68
499b151f67fbf), its licence in static/chart.js.LICENSE.md. Served by this app, not a CDN: many deployments (and
the test machines) have no internet.

Authentication: the page and its files hold no data, so they are public; the data come from the report endpoints
with the same bearer key as any API client. The key is given once, in the page's sign-in form or in the URL
fragment (`/dashboard#key=tf-...`, handy for a link or a headless browser): a fragment is never sent to a server,
so no access or proxy log holds the key (a `?key=` query would be logged). The script moves it to sessionStorage
(this tab only, gone when it closes), clears it from the address bar, and sends it as `Authorization: Bearer` on
each fetch. The page's Content-Security-Policy admits scripts from this origin only, so no injected script can
read the key out of sessionStorage, and its form cannot be submitted anywhere (the script reads it instead)."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).with_name("static")
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                           "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def page() -> FileResponse:
    """The page itself; `no-cache` so that a deployment's new page (and script paths) is seen at once."""
    headers = {"content-security-policy": CONTENT_SECURITY_POLICY, "referrer-policy": "no-referrer",
               "x-content-type-options": "nosniff", "cache-control": "no-cache"}
    return FileResponse(STATIC / "dashboard.html", media_type="text/html; charset=utf-8", headers=headers)


def mount(app: FastAPI) -> None:
    """Adds the page and its files to the finance app (a mount, not a router: FastAPI's include_router drops
    mounts)."""
    app.add_api_route("/dashboard", page, methods=["GET"], include_in_schema=False)
    app.mount("/dashboard/static", StaticFiles(directory=STATIC), name="dashboard-static")

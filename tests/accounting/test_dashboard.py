"""The finance dashboard in a real headless Chromium, against the real app under uvicorn, a real ledger (PostgreSQL
at DATABASE_URL, else SQLite) and a real (embedded) Redis holding the API keys.

No Selenium: Chromium's own `--dump-dom` gives the DOM after the page's scripts ran, where the page writes what
each chart drew (data attributes), compared here with sums of the crafted ledger rows; `--screenshot` gives a PNG,
decoded here (zlib and numpy) to check that each chart's colours really cover its canvas.

Chromium: CHROMIUM, else chromium / chromium-browser / google-chrome on PATH (Debian: `apt-get install -y
chromium`); the Chromium tests skip, saying so, without one. With TOKENFLEET_SAVE_SCREENSHOT=1 the drawn page is
also saved to bench/results/dashboard.png."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import socket
import struct
import subprocess
import threading
import time
import uuid
import zlib
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import uvicorn
from fastapi.testclient import TestClient

from services.accounting import dashboard, ledger
from services.accounting.api import create_finance_app
from services.base import protocol as p
from services.base.redis_client import connect
from services.tenancy.prices import PriceTable
from services.tenancy.sla import SlaPolicy

PRICES, SLA = PriceTable.load(), SlaPolicy.load()
REPO = Path(__file__).resolve().parents[2]
DAY0 = datetime(2025, 3, 1, tzinfo=UTC)
WINDOW = "start=2025-03-01T00:00:00Z&end=2025-03-05T00:00:00Z"  # 4 UTC days, the last one empty
DAYS = 4
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
INSTALL_HINT = "install it with `apt-get install -y chromium` or point CHROMIUM at a Chromium or Chrome binary"
SCREEN = (1280, 900)
# A dataset's colour must cover more than its 12x12 legend swatch (plus antialiased edges) to count as drawn.
MIN_DRAWN_PIXELS = 400


# --- the ledger ----------------------------------------------------------------------------------------------

def _row(at: datetime, tenant: str, model: str, list_usd: str, measured_usd: str, completion_tokens: int,
         sla_met: bool = True, status: str = "ok") -> dict:
    event = p.CompletionEvent(
        request_id=uuid.uuid4().hex, model=model, worker_id="w1", worker_class="cpu", api_key_name=tenant,
        finish_reasons=["stop"], usage=p.Usage(prompt_tokens=100, completion_tokens=completion_tokens),
        timing=p.Timing(queue_s=0.01, ttft_s=0.2, tpot_s=0.02, e2e_s=0.6, engine_s=0.55, engine_step_s=0.36),
        finished_at=at.timestamp())
    return ledger.row(event, PRICES, SLA) | {"list_cost_usd": Decimal(list_usd),
                                             "measured_cost_usd": Decimal(measured_usd), "sla_met": sla_met,
                                             "status": status}


def _crafted_rows() -> tuple[list[dict], list[dict]]:
    """(rows inside the window, rows just outside it). Bars are kept large enough to see in the screenshot."""
    def day(n: int, hours: int = 9, seconds: int = 0) -> datetime:
        return DAY0 + timedelta(days=n, hours=hours, seconds=seconds)

    inside = [
        _row(day(0), "acme", "tokenfleet-large", "0.040", "0.015", 400),
        _row(day(0, 10), "acme", "tokenfleet-small", "0.010", "0.004", 250),
        _row(day(0, 11), "globex", "tokenfleet-large", "0.060", "0.020", 500, sla_met=False),
        _row(day(1), "globex", "tokenfleet-small", "0.030", "0.012", 300),
        _row(day(1, 1), "initech", "tokenfleet-large", "0.020", "0.010", 200),
        _row(day(1, 2), "initech", "tokenfleet-large", "0.005", "0.002", 0, sla_met=False, status="error"),
        _row(day(2, 23, 3599), "acme", "tokenfleet-large", "0.050", "0.025", 600),  # the day's last second
        _row(day(2, 3), "acme", "tokenfleet-small", "0.015", "0.006", 150),
        _row(day(2, 4), "globex", "tokenfleet-embed", "0.001", "0.001", 0),  # no output tokens: no cost per token
    ]
    outside = [_row(DAY0 - timedelta(seconds=1), "acme", "tokenfleet-large", "9", "9", 100),
               _row(DAY0 + timedelta(days=DAYS), "globex", "tokenfleet-large", "9", "9", 100)]  # end is exclusive
    return inside, outside


def _expected(rows: list[dict]) -> dict[str, dict]:
    """What each chart should draw, from the rows: per chart its labels and series, as the page reports them."""
    per_day = {name: [Decimal(0)] * DAYS for name in ("list", "measured")}
    tasks, met = [0] * DAYS, [0] * DAYS
    models: dict[str, list] = defaultdict(lambda: [Decimal(0), Decimal(0), 0])
    tenants: dict[str, list] = defaultdict(lambda: [Decimal(0), Decimal(0)])
    for row in rows:
        n = (row["finished_at"] - DAY0).days
        per_day["list"][n] += row["list_cost_usd"]
        per_day["measured"][n] += row["measured_cost_usd"]
        tasks[n], met[n] = tasks[n] + 1, met[n] + row["sla_met"]
        model = models[row["model"]]
        model[0], model[1], model[2] = (model[0] + row["list_cost_usd"], model[1] + row["measured_cost_usd"],
                                        model[2] + row["completion_tokens"])
        tenant = tenants[row["tenant"]]
        tenant[0], tenant[1] = tenant[0] + row["list_cost_usd"], tenant[1] + row["measured_cost_usd"]
    priced = sorted(name for name, (_, _, tokens) in models.items() if tokens)
    ranked = sorted(tenants, key=lambda name: tenants[name][0], reverse=True)
    days = [(DAY0 + timedelta(days=n)).date().isoformat() for n in range(DAYS)]
    return {
        "cost-per-day": {"labels": days, "series": {k: [float(v) for v in per_day[k]] for k in per_day}},
        "cost-per-1m-output": {"labels": priced, "series": {
            "list": [float(models[m][0] * 1_000_000 / models[m][2]) for m in priced],
            "measured": [float(models[m][1] * 1_000_000 / models[m][2]) for m in priced]}},
        "sla": {"labels": days, "series": {
            "attainment_pct": [100 * m / t if t else None for m, t in zip(met, tasks, strict=True)],
            "goodput_per_s": [m / 86_400 for m in met]}, "tasks": sum(tasks), "met": sum(met)},
        "top-tenants": {"labels": ranked, "series": {"list": [float(tenants[t][0]) for t in ranked],
                                                     "measured": [float(tenants[t][1]) for t in ranked]}},
    }


# --- the servers ---------------------------------------------------------------------------------------------

class FinanceServer:
    """The finance app under uvicorn on a loop of its own in a thread, on a port the OS picked; its Redis client
    is made and closed on that loop (a client's connections belong to the loop that opened them)."""

    def __init__(self, engine, redis_url: str):
        self.engine, self.redis_url = engine, redis_url
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server: uvicorn.Server | None = None
        self.thread = threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True)

    async def _serve(self) -> None:
        redis = connect(self.redis_url)
        config = uvicorn.Config(create_finance_app(self.engine, redis), log_config=None, lifespan="off")
        self.server = uvicorn.Server(config)
        try:
            await self.server.serve(sockets=[self.sock])
        finally:
            await redis.aclose()

    def __enter__(self) -> FinanceServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not (self.server and self.server.started):
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@pytest.fixture
def served(ledger_engine, redis_keys, caplog):
    """(the server, the keys, the rows inside the window); the access log is captured (caplog) to check that
    no request line carries a key."""
    inside, outside = _crafted_rows()
    assert len(ledger.record(ledger_engine, inside + outside)) == len(inside + outside)
    caplog.set_level(logging.INFO, logger="uvicorn.access")
    with FinanceServer(ledger_engine, redis_keys[0]) as server:
        yield server, redis_keys[1], inside


# --- Chromium ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def chromium() -> str:
    found = os.environ.get("CHROMIUM") or next(filter(None, map(shutil.which, CHROMIUM_NAMES)), None)
    if not found:
        reason = f"no Chromium (CHROMIUM unset, none of {', '.join(CHROMIUM_NAMES)} on PATH): {INSTALL_HINT}"
        print(reason)
        pytest.skip(reason)
    return found


def _browse(chromium: str, url: str, tmp_path: Path, *action: str) -> str:
    """Runs headless Chromium on `url` (a fresh profile each time) until its page settles; returns stdout.
    Virtual time runs the page's timers without waiting and pauses while its fetches are in flight."""
    profile = tmp_path / f"profile-{uuid.uuid4().hex[:8]}"
    command = [chromium, "--headless=new", "--disable-gpu", "--no-sandbox", "--no-first-run",
               "--no-default-browser-check", "--hide-scrollbars", f"--user-data-dir={profile}",
               f"--window-size={SCREEN[0]},{SCREEN[1]}", "--virtual-time-budget=10000", *action, url]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


class _Annotations(HTMLParser):
    """The <body>'s and each <figure data-chart>'s attributes, and which ids are hidden."""

    def __init__(self):
        super().__init__()
        self.body: dict[str, str] = {}
        self.figures: dict[str, dict[str, str]] = {}
        self.hidden: set[str] = set()
        self.text = ""

    def handle_starttag(self, tag, attrs):
        attributes = {name: value or "" for name, value in attrs}
        if tag == "body":
            self.body = attributes
        elif tag == "figure" and "data-chart" in attributes:
            self.figures[attributes["data-chart"]] = attributes
        if "id" in attributes and "hidden" in attributes:
            self.hidden.add(attributes["id"])


def _dom(chromium: str, url: str, tmp_path: Path) -> _Annotations:
    annotations = _Annotations()
    annotations.text = _browse(chromium, url, tmp_path, "--dump-dom")
    annotations.feed(annotations.text)
    return annotations


def _drawn(figure: dict[str, str]) -> dict:
    return {"state": figure.get("data-state"), "points": int(figure["data-points"]),
            "labels": json.loads(figure["data-labels"]), "series": json.loads(figure["data-series"]),
            "totals": json.loads(figure["data-totals"]), "colours": json.loads(figure["data-colours"])}


# --- the screenshot ------------------------------------------------------------------------------------------

def _png_pixels(data: bytes) -> np.ndarray:
    """An 8-bit RGB or RGBA, non-interlaced PNG (what Chromium writes) as an array of rows of RGB pixels."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks, pos = defaultdict(bytes), 8
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunks[kind] += data[pos + 8:pos + 8 + length]
        pos += 12 + length
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", chunks[b"IHDR"])
    assert depth == 8 and colour in (2, 6) and interlace == 0, "not an 8-bit RGB(A) non-interlaced PNG"
    channels = 3 if colour == 2 else 4
    raw = np.frombuffer(zlib.decompress(chunks[b"IDAT"]), np.uint8).reshape(height, 1 + width * channels)
    image = np.zeros((height, width * channels), np.uint8)
    previous = np.zeros(width * channels, np.uint8)
    for y in range(height):
        image[y] = previous = _unfilter(raw[y, 0], raw[y, 1:], previous, channels)
    return image.reshape(height, width, channels)[:, :, :3]


def _unfilter(kind: int, line: np.ndarray, above: np.ndarray, bpp: int) -> np.ndarray:
    """One scanline's PNG filter undone: none, sub and up vectorised; average and paeth byte by byte (each byte
    depends on the one just decoded to its left)."""
    if kind == 0:
        return line
    if kind == 1:
        return np.cumsum(line.reshape(-1, bpp), axis=0, dtype=np.uint8).reshape(-1)  # uint8 sums wrap mod 256
    if kind == 2:
        return line + above
    out, up = bytearray(line.tobytes()), above.tobytes()
    for i in range(len(out)):
        left, corner = (out[i - bpp], up[i - bpp]) if i >= bpp else (0, 0)
        out[i] = (out[i] + (_paeth(left, up[i], corner) if kind == 4 else (left + up[i]) // 2)) & 0xFF
    return np.frombuffer(bytes(out), np.uint8)


def _paeth(left: int, up: int, corner: int) -> int:
    guess = left + up - corner
    near_left, near_up, near_corner = abs(guess - left), abs(guess - up), abs(guess - corner)
    if near_left <= near_up and near_left <= near_corner:
        return left
    return up if near_up <= near_corner else corner


def _pixels_of(image: np.ndarray, colour: str) -> int:
    rgb = np.array([int(colour[i:i + 2], 16) for i in (1, 3, 5)], np.int16)
    return int((np.abs(image.astype(np.int16) - rgb).max(axis=-1) <= 3).sum())


def _screenshot(chromium: str, url: str, tmp_path: Path) -> tuple[Path, np.ndarray]:
    path = tmp_path / f"dashboard-{uuid.uuid4().hex[:8]}.png"
    _browse(chromium, url, tmp_path, f"--screenshot={path}")
    return path, _png_pixels(path.read_bytes())


# --- the tests -----------------------------------------------------------------------------------------------

def _assert_drew(figure: dict, expected: dict) -> None:
    assert figure["state"] == "drawn"
    assert figure["labels"] == expected["labels"] and figure["points"] == len(expected["labels"])
    for name, values in expected["series"].items():
        drawn = figure["series"][name]
        assert [v is None for v in drawn] == [v is None for v in values], name  # gaps where a bucket had no task
        assert [v for v in drawn if v is not None] == pytest.approx([v for v in values if v is not None],
                                                                    rel=1e-9, abs=1e-15), name
        assert figure["totals"][name] == pytest.approx(sum(v or 0 for v in values), rel=1e-9, abs=1e-15), name


def test_the_charts_draw_the_ledgers_numbers_for_an_admin(served, chromium, tmp_path, caplog):
    server, keys, rows = served
    url = f"{server.url}/dashboard?{WINDOW}#key={keys['ops']}"
    page = _dom(chromium, url, tmp_path)
    assert page.body.get("data-dashboard") == "ready", page.body
    expected = _expected(rows)
    assert sorted(page.figures) == sorted(expected)
    for name, figure in page.figures.items():
        _assert_drew(_drawn(figure), expected[name])
    sla = _drawn(page.figures["sla"])["totals"]
    assert (sla["tasks"], sla["met"]) == (expected["sla"]["tasks"], expected["sla"]["met"])
    # the key travelled only in the fragment and a header: no request line the server logged carries it
    lines = [record.getMessage() for record in caplog.records if record.name == "uvicorn.access"]
    assert any("/v1/reports/cost" in line for line in lines) and not any(keys["ops"] in line for line in lines)

    path, image = _screenshot(chromium, url, tmp_path)
    for name, figure in page.figures.items():
        for series, colour in _drawn(figure)["colours"].items():
            assert _pixels_of(image, colour) > MIN_DRAWN_PIXELS, f"{name}: {series} ({colour}) not drawn"
    if os.environ.get("TOKENFLEET_SAVE_SCREENSHOT"):
        target = REPO / "bench" / "results" / "dashboard.png"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)


def test_a_tenants_key_draws_only_its_own_spend(served, chromium, tmp_path):
    server, keys, rows = served
    page = _dom(chromium, f"{server.url}/dashboard?{WINDOW}#key={keys['acme']}", tmp_path)
    assert page.body.get("data-dashboard") == "ready", page.body
    expected = _expected([row for row in rows if row["tenant"] == "acme"])
    for name, figure in page.figures.items():
        _assert_drew(_drawn(figure), expected[name])
    assert _drawn(page.figures["top-tenants"])["labels"] == ["acme"]


def test_without_a_valid_key_the_page_asks_for_one_and_draws_nothing(served, chromium, tmp_path):
    server, _, _ = served
    for fragment, status in (("", ""), ("#key=tf-not-a-key", "Sign-in failed")):
        page = _dom(chromium, f"{server.url}/dashboard?{WINDOW}{fragment}", tmp_path)
        assert page.body.get("data-dashboard") == "signed-out"
        assert "sign-in" not in page.hidden and "charts" in page.hidden
        assert all("data-state" not in figure for figure in page.figures.values())
        assert status in page.text
    # the blank baseline of the pixel check: no chart colour anywhere on the signed-out page
    _, image = _screenshot(chromium, f"{server.url}/dashboard?{WINDOW}", tmp_path)
    script = (dashboard.STATIC / "dashboard.js").read_text()
    colours = set(re.findall(r"#[0-9a-f]{6}", script[script.index("const COLOURS"):script.index("const LABELS")]))
    assert len(colours) == 8 and all(_pixels_of(image, colour) == 0 for colour in colours)


def test_the_page_and_its_files_are_public_with_a_strict_content_security_policy(ledger_engine, redis_keys):
    redis = connect(redis_keys[0])
    with TestClient(create_finance_app(ledger_engine, redis)) as client:
        page = client.get("/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        policy = page.headers["content-security-policy"]
        assert "script-src 'self'" in policy and "form-action 'none'" in policy
        assert page.headers["referrer-policy"] == "no-referrer"
        for name in ("chart.umd.js", "dashboard.js", "dashboard.css"):
            assert f"dashboard/static/{name}" in page.text
            assert client.get(f"/dashboard/static/{name}").status_code == 200
        assert client.get("/dashboard/static/chart.umd.js").text.startswith("/*!\n * Chart.js v4.6.1")
        assert client.get("/dashboard/static/../api.py").status_code == 404
        client.portal.call(redis.aclose)
    assert "MIT License" in (dashboard.STATIC / "chart.js.LICENSE.md").read_text()

// The finance dashboard: the finance API's cost and goodput reports drawn with Chart.js (window.Chart, vendored
// next to this file). No build step and no framework: this file is the page's whole logic.
//
// The API key: given once, in the sign-in form or in the URL fragment (/dashboard#key=tf-...), then kept in
// sessionStorage (this tab, until it closes) and sent as `Authorization: Bearer` on each fetch. A fragment never
// leaves the browser, so no access log or proxy sees the key, and it is wiped from the address bar at once.
//
// The window: ?start=...&end=... (ISO-8601, UTC when no offset is given; default the 7 days up to the next whole
// hour) and ?bucket=hour|day for the SLA chart (default hour up to 2 days, else day).
//
// After drawing, each <figure data-chart> carries what it drew as data attributes (points, labels, series,
// totals, colours) and <body data-dashboard> says ready / signed-out / error: a headless browser's DOM dump can
// check the charts against the ledger without reading pixels.
"use strict";

const KEY_SLOT = "tokenfleet.finance.key";
const HOUR_MS = 3_600_000;
const DAY_MS = 24 * HOUR_MS;
const DEFAULT_SPAN_MS = 7 * DAY_MS;
const HOURLY_UP_TO_MS = 2 * DAY_MS;
const MAX_BUCKETS = 200; // the SLA chart asks one goodput report per bucket: a careless window must not flood the API
const PARALLEL = 6; // a browser's connections per host over HTTP/1.1
const TOP_TENANTS = 10;
// One colour per dataset, used nowhere else on the page (the CSS is grey): the test finds each chart's pixels by them.
const COLOURS = Object.freeze({
  "cost-per-day": { list: "#1f77b4", measured: "#ff7f0e" },
  "cost-per-1m-output": { list: "#17becf", measured: "#bcbd22" },
  sla: { attainment_pct: "#2ca02c", goodput_per_s: "#9467bd" },
  "top-tenants": { list: "#d62728", measured: "#8c564b" },
});
const LABELS = Object.freeze({
  list: "list price", measured: "measured (GPU time)", attainment_pct: "SLA attainment %",
  goodput_per_s: "goodput (met tasks / s)",
});

class SignedOut extends Error {}

// --- the key -------------------------------------------------------------------------------------------------

function takeKey() {
  const given = new URLSearchParams(location.hash.slice(1)).get("key");
  if (given) {
    sessionStorage.setItem(KEY_SLOT, given.trim());
    history.replaceState(null, "", location.pathname + location.search); // out of the address bar and history
  }
  return sessionStorage.getItem(KEY_SLOT);
}

// --- the window ----------------------------------------------------------------------------------------------

function parseTime(text) {
  // JavaScript reads a date-time without an offset as local time; the API reads it as UTC, and so does the page
  return Date.parse(/T[\d:.]+$/.test(text) ? `${text}Z` : text);
}

function parseWindow(search) {
  const query = new URLSearchParams(search);
  const end = query.has("end") ? parseTime(query.get("end")) : Math.ceil(Date.now() / HOUR_MS) * HOUR_MS;
  const start = query.has("start") ? parseTime(query.get("start")) : end - DEFAULT_SPAN_MS;
  if (Number.isNaN(start) || Number.isNaN(end) || start >= end) {
    throw new Error("start and end must be ISO-8601 times, start before end");
  }
  const bucket = query.get("bucket") || (end - start <= HOURLY_UP_TO_MS ? "hour" : "day");
  if (bucket !== "hour" && bucket !== "day") throw new Error("bucket must be hour or day");
  return { start, end, bucket, unitMs: bucket === "hour" ? HOUR_MS : DAY_MS };
}

function bucketStarts(win, unitMs) {
  // epoch milliseconds divisible by a day are UTC midnights, as the API's buckets are
  const starts = [];
  for (let at = Math.floor(win.start / unitMs) * unitMs; at < win.end; at += unitMs) starts.push(at);
  return starts;
}

const iso = (ms) => new Date(ms).toISOString();
const shortIso = (ms) => iso(ms).replace(":00.000Z", "Z");
const compact = new Intl.NumberFormat("en", { maximumSignificantDigits: 3 }); // 0.00005, not 5.000000E-5
const dayLabel = (ms) => iso(ms).slice(0, 10);
const hourLabel = (ms) => `${iso(ms).slice(5, 10)} ${iso(ms).slice(11, 16)}`;
const usd = (text) => Number(text); // exact decimal strings from the API; a chart only needs floats

// --- fetching ------------------------------------------------------------------------------------------------

async function getJson(key, path, params) {
  const url = new URL(path, document.baseURI);
  for (const [name, value] of Object.entries(params)) url.searchParams.set(name, value);
  const response = await fetch(url, { headers: { authorization: `Bearer ${key}` }, cache: "no-store" });
  const body = await response.json().catch(() => ({}));
  if (response.status === 401) throw new SignedOut(body.error?.message || "unknown API key");
  if (!response.ok) throw new Error(`${path}: ${body.error?.message || response.status}`);
  return body;
}

async function limited(jobs, width) {
  // the jobs' results in order, at most `width` running at once
  const results = new Array(jobs.length);
  let next = 0;
  const worker = async () => {
    while (next < jobs.length) {
      const index = next++;
      results[index] = await jobs[index]();
    }
  };
  await Promise.all(Array.from({ length: Math.min(width, jobs.length) }, worker));
  return results;
}

async function load(key, win) {
  const range = { start: iso(win.start), end: iso(win.end) };
  const slots = bucketStarts(win, win.unitMs);
  if (slots.length > MAX_BUCKETS) throw new Error(`${slots.length} ${win.bucket}s: use bucket=day or a shorter window`);
  const goodputJobs = slots.map((at) => () => getJson(key, "v1/reports/goodput", {
    start: iso(Math.max(at, win.start)), end: iso(Math.min(at + win.unitMs, win.end)),
  }));
  const [daily, overall, goodput] = await Promise.all([
    getJson(key, "v1/reports/cost", { ...range, group_by: "day" }),
    getJson(key, "v1/reports/cost", range),
    limited(goodputJobs, PARALLEL),
  ]);
  return { daily: daily.data, overall: overall.data, goodput, slots };
}

// --- reports to series ---------------------------------------------------------------------------------------

function costPerDay(groups, win) {
  const days = bucketStarts(win, DAY_MS);
  const index = new Map(days.map((at, i) => [at, i]));
  const list = days.map(() => 0);
  const measured = days.map(() => 0);
  for (const group of groups) {
    const i = index.get(Date.parse(group.bucket));
    list[i] += usd(group.list_cost_usd);
    measured[i] += usd(group.measured_cost_usd);
  }
  return { labels: days.map(dayLabel), series: { list, measured } };
}

function sumBy(groups, field) {
  // per value of `field`: list and measured cost and output tokens, summed over the other keys
  const sums = new Map();
  for (const group of groups) {
    const sum = sums.get(group[field]) || { list: 0, measured: 0, tokens: 0 };
    sum.list += usd(group.list_cost_usd);
    sum.measured += usd(group.measured_cost_usd);
    sum.tokens += group.completion_tokens;
    sums.set(group[field], sum);
  }
  return [...sums];
}

function costPerMillionOutput(groups) {
  // a model without output tokens has no cost per token, so no bar
  const models = sumBy(groups, "model").filter(([, sum]) => sum.tokens > 0).sort(([a], [b]) => a.localeCompare(b));
  const per = (name) => models.map(([, sum]) => (sum[name] * 1e6) / sum.tokens);
  return { labels: models.map(([model]) => model), series: { list: per("list"), measured: per("measured") } };
}

function topTenants(groups) {
  const ranked = sumBy(groups, "tenant").sort(([, a], [, b]) => b.list - a.list).slice(0, TOP_TENANTS);
  return {
    labels: ranked.map(([tenant]) => tenant),
    series: { list: ranked.map(([, sum]) => sum.list), measured: ranked.map(([, sum]) => sum.measured) },
  };
}

function slaOverTime(reports, slots, win) {
  const attainment = [];
  const goodput = [];
  let tasks = 0;
  let met = 0;
  for (const report of reports) {
    const bucketTasks = report.data.reduce((n, group) => n + group.tasks, 0);
    const bucketMet = report.data.reduce((n, group) => n + group.met, 0);
    attainment.push(bucketTasks ? (100 * bucketMet) / bucketTasks : null); // no task: no attainment, a gap
    goodput.push(bucketMet / report.window_s);
    tasks += bucketTasks;
    met += bucketMet;
  }
  return {
    labels: slots.map(win.bucket === "hour" ? hourLabel : dayLabel),
    series: { attainment_pct: attainment, goodput_per_s: goodput }, extra: { tasks, met },
  };
}

// --- drawing -------------------------------------------------------------------------------------------------

function baseOptions(extra) {
  // a fresh object per chart: Chart.js keeps a reference to its options
  return {
    animation: false, // drawn at once: a screenshot or DOM dump right after load sees the finished chart
    responsive: true, maintainAspectRatio: false,
    plugins: { legend: { labels: { boxWidth: 12, boxHeight: 12 } } },
    ...extra,
  };
}

function bars(name, series, values) {
  return { label: LABELS[series], data: values, backgroundColor: COLOURS[name][series], borderWidth: 0 };
}

function chartConfig(name, drawn) {
  const { labels, series } = drawn;
  if (name === "sla") {
    return {
      data: {
        labels, datasets: [
          { type: "line", label: LABELS.attainment_pct, data: series.attainment_pct, yAxisID: "pct",
            borderColor: COLOURS.sla.attainment_pct, backgroundColor: COLOURS.sla.attainment_pct, borderWidth: 3,
            pointRadius: 4, clip: 6 }, // a point at 100 % is drawn whole, not cut by the axis' top
          { type: "bar", ...bars("sla", "goodput_per_s", series.goodput_per_s), yAxisID: "rate" },
        ],
      },
      options: baseOptions({ scales: {
        pct: { position: "left", min: 0, max: 100, title: { display: true, text: "%" } },
        rate: { position: "right", beginAtZero: true, grid: { drawOnChartArea: false },
          ticks: { callback: (value) => compact.format(value) }, title: { display: true, text: "tasks / s" } },
      } }),
    };
  }
  const datasets = Object.keys(series).map((key) => bars(name, key, series[key]));
  const horizontal = name === "top-tenants" ? { indexAxis: "y" } : {};
  return { type: "bar", data: { labels, datasets }, options: baseOptions(horizontal) };
}

function totals(series, extra) {
  const sums = {};
  for (const [key, values] of Object.entries(series)) sums[key] = values.reduce((n, v) => n + (v ?? 0), 0);
  return { ...sums, ...extra };
}

function draw(name, drawn) {
  const figure = document.querySelector(`figure[data-chart="${name}"]`);
  Object.assign(figure.dataset, {
    points: String(drawn.labels.length), labels: JSON.stringify(drawn.labels),
    series: JSON.stringify(drawn.series), totals: JSON.stringify(totals(drawn.series, drawn.extra)),
    colours: JSON.stringify(COLOURS[name]),
  });
  if (!drawn.labels.length) {
    figure.dataset.state = "empty";
    return;
  }
  new Chart(figure.querySelector("canvas"), chartConfig(name, drawn));
  figure.dataset.state = "drawn";
}

function render(reports, win) {
  document.getElementById("charts").hidden = false;
  const perDay = costPerDay(reports.daily, win);
  const sla = slaOverTime(reports.goodput, reports.slots, win);
  draw("cost-per-day", perDay);
  draw("cost-per-1m-output", costPerMillionOutput(reports.overall));
  draw("sla", sla);
  draw("top-tenants", topTenants(reports.overall));
  const sum = totals(perDay.series);
  const share = sla.extra.tasks ? ` (${((100 * sla.extra.met) / sla.extra.tasks).toFixed(1)} %)` : "";
  document.getElementById("totals").textContent = `List cost $${sum.list.toFixed(6)}, measured $${
    sum.measured.toFixed(6)}; ${sla.extra.tasks} tasks, ${sla.extra.met} met their SLA${share}.`;
}

// --- the page's states ---------------------------------------------------------------------------------------

function setState(state, message) {
  document.body.dataset.dashboard = state;
  document.getElementById("status").textContent = message || "";
}

function showSignIn(message) {
  sessionStorage.removeItem(KEY_SLOT);
  document.getElementById("sign-in").hidden = false;
  document.getElementById("charts").hidden = true;
  document.getElementById("sign-out").hidden = true;
  setState("signed-out", message);
}

function wireControls() {
  document.getElementById("sign-in").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY_SLOT, new FormData(event.target).get("key").trim());
    location.reload();
  });
  const signOut = document.getElementById("sign-out");
  signOut.addEventListener("click", () => showSignIn("Signed out."));
  return signOut;
}

async function main() {
  const signOut = wireControls();
  const key = takeKey();
  if (!key) return showSignIn("");
  signOut.hidden = false;
  try {
    if (typeof Chart === "undefined") throw new Error("the charting library did not load");
    const win = parseWindow(location.search);
    document.getElementById("window").textContent = `${shortIso(win.start)} to ${shortIso(win.end)} (UTC), SLA by ${
      win.bucket}`;
    render(await load(key, win), win);
    setState("ready");
  } catch (error) {
    if (error instanceof SignedOut) return showSignIn(`Sign-in failed: ${error.message}`);
    document.getElementById("charts").hidden = true;
    setState("error", `Could not draw the dashboard: ${error.message}`);
  }
}

main();

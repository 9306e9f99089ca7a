"""`tokenfleet bench serving`: its metrics, and its client against a real tiny SSE server on localhost."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import threading
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import httpx
import pytest

from bench import serving
from bench.serving import RequestResult, parse_slo, poisson_arrivals, send_one, summarize

TIMING = {"queue_s": 0.01, "ttft_s": 0.1, "tpot_s": 0.05, "e2e_s": 0.25, "engine_s": 0.24, "engine_step_s": 0.2,
          "route_s": 0.003, "worker_id": "w0", "model": "tokenfleet-small"}


def chat_chunk(content: str | None = None, role: str | None = None) -> dict:
    delta = {k: v for k, v in (("role", role), ("content", content)) if v is not None}
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


USAGE_CHUNK = {"object": "chat.completion.chunk", "choices": [],
               "usage": {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}, "tokenfleet": TIMING}
# (delay before the event in seconds, the event's JSON): a role-only chunk at once, first content after 0.1 s,
# then three more content chunks 0.05 s apart, then the usage chunk with the gateway's timing field.
STREAM = [(0.0, chat_chunk(role="assistant", content="")), (0.1, chat_chunk("Hello")), (0.05, chat_chunk(" there")),
          (0.05, chat_chunk(",")), (0.05, chat_chunk(" friend")), (0.0, USAGE_CHUNK)]


@asynccontextmanager
async def sse_server(events, status: int = 200, done: bool = True):
    """A real HTTP/1.1 server on an ephemeral localhost port that answers every POST with `events` as SSE (or
    with `status` and a JSON error). Yields (base_url, received) where received collects (headers, body)."""
    received: list[tuple[dict, dict]] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        headers = dict(line.split(": ", 1) for line in head.split("\r\n")[1:] if ": " in line)
        headers = {k.lower(): v for k, v in headers.items()} | {":path": head.split(" ")[1]}
        received.append((headers, json.loads(await reader.readexactly(int(headers["content-length"])))))
        if status != 200:
            body = json.dumps({"error": {"message": "overloaded", "type": "server_error"}}).encode()
            writer.write(b"HTTP/1.1 %d Error\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                         b"Connection: close\r\n\r\n%s" % (status, len(body), body))
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
            for delay, event in events:
                await asyncio.sleep(delay)
                writer.write(f"data: {json.dumps(event)}\n\n".encode())
                await writer.drain()
            if done:
                writer.write(b"data: [DONE]\n\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"http://127.0.0.1:{port}/v1", received


@contextmanager
def sse_server_in_thread(events, status: int = 200):
    """sse_server on its own event loop in a thread, for code that runs asyncio.run itself."""
    loop, ready, box = asyncio.new_event_loop(), threading.Event(), {}

    async def serve():
        box["stop"] = asyncio.Event()
        async with sse_server(events, status) as (base, received):
            box.update(base=base, received=received)
            ready.set()
            await box["stop"].wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(10), "test server did not start"
    try:
        yield box["base"], box["received"]
    finally:
        loop.call_soon_threadsafe(box["stop"].set)
        thread.join(10)
        loop.close()


def result(ttft: float, e2e: float, tokens: int, ok: bool = True, server: dict | None = None) -> RequestResult:
    return RequestResult(ok=ok, error=None if ok else "HTTP 500", prompt_tokens=10, output_tokens=tokens,
                         ttft_s=ttft, itl_s=[(e2e - ttft) / max(1, tokens - 1)] * (tokens - 1), e2e_s=e2e,
                         server=server)


def test_goodput_counts_only_requests_that_meet_every_slo():
    slos = {"ttft_ms": 100.0, "tpot_ms": 20.0}
    results = [
        result(ttft=0.05, e2e=0.05 + 9 * 0.010, tokens=10),  # meets both
        result(ttft=0.20, e2e=0.20 + 9 * 0.010, tokens=10),  # TTFT too slow
        result(ttft=0.05, e2e=0.05 + 9 * 0.030, tokens=10),  # TPOT too slow
        result(ttft=0.05, e2e=0.05, tokens=1),  # one token: TPOT counts as 0, so it meets both
        result(ttft=0.01, e2e=0.02, tokens=2, ok=False),  # failed: never good
    ]
    summary = summarize(results, duration_s=2.0, slos=slos)
    assert summary["goodput"] == pytest.approx(2 / 2.0)
    assert summary["request_throughput"] == pytest.approx(4 / 2.0)
    assert summarize(results, duration_s=2.0)["goodput"] is None  # no SLOs given: no goodput


def test_parse_slo_accepts_any_subset_of_the_known_keys():
    assert parse_slo("ttft_ms=200, e2e_ms=2000") == {"ttft_ms": 200.0, "e2e_ms": 2000.0}
    assert parse_slo("") == {}


def test_parse_slo_rejects_unknown_keys_with_a_clear_error():
    with pytest.raises(ValueError, match=r"unknown SLO key 'itl_ms'.*expected one of ttft_ms, tpot_ms, e2e_ms"):
        parse_slo("ttft_ms=200,itl_ms=10")


def test_slo_flag_reports_the_parse_error_on_the_command_line(capsys):
    parser = argparse.ArgumentParser()
    serving.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--slo", "latency=5"])
    assert "unknown SLO key 'latency'" in capsys.readouterr().err


def test_poisson_arrivals_are_reproducible_and_have_the_requested_mean_rate():
    a, b = poisson_arrivals(2000, rate=10.0, seed=3), poisson_arrivals(2000, rate=10.0, seed=3)
    assert a == b
    assert a != poisson_arrivals(2000, rate=10.0, seed=4)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:], strict=False))
    assert (len(a) - 1) / a[-1] == pytest.approx(10.0, rel=0.1)


def test_infinite_request_rate_sends_everything_at_once():
    assert poisson_arrivals(5, rate=math.inf) == [0.0] * 5


def test_summarize_takes_tpot_from_usage_tokens_and_overhead_and_routing_from_the_tokenfleet_field():
    # 5 output tokens by usage, though only 2 content chunks arrived: TPOT = (e2e - ttft) / (5 - 1).
    r = RequestResult(ok=True, prompt_tokens=12, output_tokens=5, ttft_s=0.1, itl_s=[0.4], e2e_s=0.5,
                      server=dict(TIMING, engine_s=0.46))
    plain = RequestResult(ok=True, prompt_tokens=8, output_tokens=1, ttft_s=0.2, e2e_s=0.2)
    summary = summarize([r, plain], duration_s=1.0)
    assert summary["tpot_ms"]["p50"] == pytest.approx(100.0)  # only r has more than one token
    assert summary["overhead_ms"]["p50"] == pytest.approx(40.0)
    assert summary["route_ms"]["p50"] == pytest.approx(3.0)  # the router's part of it
    assert summary["tokenfleet_field_share"] == pytest.approx(0.5)
    assert summary["total_input_tokens"] == 20 and summary["output_throughput"] == pytest.approx(6.0)


def test_send_one_times_the_stream_and_reads_the_usage_chunk():
    async def go():
        async with sse_server(STREAM) as (base, received), httpx.AsyncClient() as client:
            body = serving.request_body("chat", "tokenfleet-small", "hello world", 16)
            return await send_one(client, base + "/chat/completions", body, api_key="sk-test"), received

    r, received = asyncio.run(go())
    assert r.ok, r.error
    assert r.ttft_s >= 0.09  # the empty role chunk at t=0 is not the first token
    # Three gaps between four content chunks; the last content came at least 0.1 + 3 * 0.05 s after sending
    # (bounds from below only: a loaded machine can delay one read and shorten the next gap).
    assert len(r.itl_s) == 3 and all(gap > 0 for gap in r.itl_s)
    assert r.e2e_s >= r.ttft_s + sum(r.itl_s) >= 0.24
    assert (r.prompt_tokens, r.output_tokens) == (11, 7)  # from usage, not the 4 content chunks
    assert r.server == TIMING
    headers, body = received[0]
    assert headers["authorization"] == "Bearer sk-test"
    assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["temperature"] == 0


@pytest.mark.parametrize("status, events, done, error", [
    (503, [], True, "HTTP 503: {\"error\": {\"message\": \"overloaded\""),
    (200, [(0.0, {"error": {"message": "worker lost"}})], True, "worker lost"),
    (200, STREAM[:3], False, "stream ended before data: [DONE]"),
])
def test_send_one_reports_errors_in_its_result_instead_of_raising(status, events, done, error):
    async def go():
        async with sse_server(events, status, done) as (base, _), httpx.AsyncClient() as client:
            return await send_one(client, base + "/completions", serving.request_body("completions", "m", "x", 4))

    r = asyncio.run(go())
    assert not r.ok and r.error.startswith(error)


def test_run_from_args_prints_a_table_and_writes_the_same_figures_as_json_and_their_picture(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    serving.add_arguments(parser)
    with sse_server_in_thread(STREAM) as (base, received):
        args = parser.parse_args(["--base-url", base, "--num-prompts", "4", "--request-rate", "50",
                                  "--max-concurrency", "2", "--input-len", "8", "--slo", "ttft_ms=5000",
                                  "--warmup", "3", "--json", str(tmp_path / "out.json")])
        assert serving.run_from_args(args) == 0
    summary = json.loads((tmp_path / "out.json").read_text())
    json.dumps(summary, allow_nan=False)  # strict JSON: no NaN or Infinity
    assert (tmp_path / "out.png").stat().st_size > 0
    assert summary["completed"] == 4 and summary["failed"] == 0 and len(received) == 3 + 4  # warm-up untimed
    assert all(len(body["messages"][0]["content"].split()) == 8 for _, body in received)
    assert summary["goodput"] == pytest.approx(summary["request_throughput"])
    assert summary["tokenfleet_field_share"] == 1.0
    table = capsys.readouterr().out
    for row in ("request throughput", "goodput", "stack overhead", "| TTFT |", "| TPOT |", "| ITL |", "| E2E |"):
        assert row in table


def _run_args(out: Path, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serving.add_arguments(parser)
    return parser.parse_args(["--num-prompts", "2", "--warmup", "0", "--json", str(out), *argv])


def test_the_base_url_may_be_given_with_or_without_v1_and_the_table_names_the_model(tmp_path, capsys):
    with sse_server_in_thread(STREAM) as (base, received):
        server = base.removesuffix("/v1")
        for given in (server, server + "/", base, base + "/"):
            assert serving.run_from_args(_run_args(tmp_path / "out.json", "--base-url", given, "--model",
                                                   "my-model")) == 0
    assert {headers[":path"] for headers, _ in received} == {"/v1/chat/completions"}
    assert "| model | my-model (chat, " in capsys.readouterr().out


def test_a_run_in_which_no_request_completed_fails_and_writes_no_result(tmp_path):
    with sse_server_in_thread(STREAM, status=404) as (base, _):
        assert serving.run_from_args(_run_args(tmp_path / "out.json", "--base-url", base)) == 1
    assert not list(tmp_path.iterdir())


def test_prompts_from_a_file_come_in_turn_from_the_named_list_and_bad_files_are_refused(tmp_path):
    sets = tmp_path / "prompts.json"
    sets.write_text(json.dumps({"quote": ["a", "b", "c"], "chat": ["x"]}))
    assert serving.file_prompts(f"{sets}:quote", 5) == ["a", "b", "c", "a", "b"]
    assert serving.file_prompts(f"{sets}:quote", 2, skip=2) == ["c", "a"]  # the warm-up's, after the run's
    listed = tmp_path / "list.json"
    listed.write_text(json.dumps(["p", "q"]))
    assert serving.file_prompts(str(listed), 3) == ["p", "q", "p"]
    with pytest.raises(SystemExit, match="not a non-empty list"):
        serving.file_prompts(str(sets), 1)  # named lists, none named

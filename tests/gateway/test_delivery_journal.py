"""The gateway's delivery journal: what each client got outlives the gateway that sent it. A gateway killed with
responses open leaves their counts to the next gateway that starts on the same directory; a live gateway's journal
is never taken; what was closed is owed to nobody."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

from gateway.delivery_journal import DeliveryJournal, open_journal


def _gateway_process(directory, script: str) -> subprocess.Popen:
    """A process holding a journal in `directory`, running `script` on it (`journal`), then waiting to be killed."""
    code = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from gateway.delivery_journal import DeliveryJournal
        journal = DeliveryJournal.take(Path({str(directory)!r}))
    """) + textwrap.dedent(script) + "\nprint('ready', flush=True)\ntime.sleep(600)\n"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _killed(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def _inherited(directory) -> dict[str, int]:
    """What a gateway starting now on `directory` is owed."""
    journal = DeliveryJournal.take(directory)
    try:
        return journal.inherited
    finally:
        journal.close()


def test_a_killed_gateways_open_responses_are_inherited_with_what_their_clients_got(tmp_path):
    dead = _gateway_process(tmp_path, """
        for rid in ("a", "b", "c"):
            journal.opened(rid)
        journal.delivered("a", 3)
        journal.delivered("a", 7)
        journal.delivered("b", 2)
        journal.closed("b")
    """)
    _killed(dead)
    assert _inherited(tmp_path) == {"a": 7, "c": 0}


def test_what_a_gateway_inherited_is_owed_again_if_it_dies_before_closing_it(tmp_path):
    first = _gateway_process(tmp_path, """
        journal.opened("a")
        journal.delivered("a", 4)
    """)
    _killed(first)
    _killed(_gateway_process(tmp_path, ""))  # takes "a" over, and dies before ending it
    assert _inherited(tmp_path) == {"a": 4}


def test_a_live_gateways_journal_is_not_taken(tmp_path):
    live = _gateway_process(tmp_path, """
        journal.opened("live")
        journal.delivered("live", 5)
    """)
    try:
        other = DeliveryJournal.take(tmp_path)
        try:
            assert other.inherited == {}
            assert other.slot != 0
        finally:
            other.close()
    finally:
        _killed(live)


def test_a_journal_whose_responses_all_closed_owes_nothing(tmp_path):
    journal = DeliveryJournal.take(tmp_path)
    journal.opened("a")
    journal.delivered("a", 9)
    journal.closed("a")
    journal.close()  # as a gateway that stops: its lock goes with it
    assert _inherited(tmp_path) == {}


def test_a_gateway_whose_journal_cannot_be_written_serves_without_one(tmp_path):
    (tmp_path / "a-file").write_text("")
    journal = open_journal(tmp_path / "a-file" / "journal")
    journal.opened("a")  # nothing kept, nothing raised
    assert journal.inherited == {}

"""Issue 40, item 6: the command-line ``client`` identity that every command in a ``bear up``
directory shares can read the other streams of that identity (840 messages of another user's). It
is said where the identity is made — ``bear nats config``'s output, the server's auth.conf, ``bear
up``'s banner (bear.commands.stack._banner, the same note) — with how to make one per user."""

from __future__ import annotations

import subprocess
import sys

from bear.runtime.nats_auth import SHARED_CLIENT, shared_client_note

from waiting import HANG_S


def test_the_note_says_what_is_shared_and_how_to_avoid_it() -> None:
    note = shared_client_note("/run/auth")
    assert f"_INBOX_{SHARED_CLIENT}.>" in note and "read the answers" in note
    assert "bear up --client alice" in note and "--nats-creds /run/auth/alice.json" in note


def test_nats_config_prints_it_and_auth_conf_marks_the_shared_identity(tmp_path) -> None:
    out = tmp_path / "auth"
    res = subprocess.run([sys.executable, "-m", "bear", "nats", "config", "--out", str(out)], capture_output=True,
                         text=True, timeout=HANG_S, check=True)
    assert f"note: {shared_client_note(out)}" in res.stdout
    conf = (out / "auth.conf").read_text()
    assert "# client — shared by every command that uses it" in conf
    # per-user identities only: no note
    res = subprocess.run([sys.executable, "-m", "bear", "nats", "config", "--out", str(tmp_path / "b"),
                          "--client", "alice", "--client", "gateway"], capture_output=True, text=True,
                         timeout=HANG_S, check=True)
    assert "note:" not in res.stdout

"""`pdserve chat` takes its messages from the arguments, piped stdin, a terminal or, with none of
those, asks one demo question."""

from __future__ import annotations

import io
import os

import pytest

from pdserve.cli import offline
from tests.cli.helpers import run_pdserve


@pytest.mark.timeout(120)
def test_piped_stdin_is_answered_a_line_at_a_time(tiny_llama):
    result = run_pdserve("chat", "--model", str(tiny_llama), "--max-tokens", "4", "--dtype", "float32",
                         input="Hi\n\n   \nHow are you?\n", timeout=100)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line for line in lines if line.startswith("user> ")] == ["user> Hi", "user> How are you?"]
    assert len([line for line in lines if line.startswith("assistant> ")]) == 2
    assert offline.DEMO_QUESTION not in result.stdout
    assert f"pdserve chat: model {tiny_llama.name} from {tiny_llama}" in result.stderr


def _messages(monkeypatch, stdin, prompts=()) -> list[str]:
    monkeypatch.setattr("sys.stdin", stdin)
    return list(offline.chat_messages(list(prompts)))


def test_message_sources(monkeypatch, tmp_path):
    piped = tmp_path / "messages.txt"
    piped.write_text("one\n\n two \n")
    with open(piped) as f:
        assert _messages(monkeypatch, f) == ["one", "two"]
    with open(piped) as f:
        assert _messages(monkeypatch, f, ["from", "argv"]) == ["from", "argv"]  # arguments win
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with open(empty) as f:
        assert _messages(monkeypatch, f) == []  # piped but empty: nothing to say
    with open(os.devnull) as f:
        assert _messages(monkeypatch, f) == [offline.DEMO_QUESTION]  # neither prompt nor piped input
    assert _messages(monkeypatch, None) == [offline.DEMO_QUESTION]  # no stdin at all
    assert _messages(monkeypatch, io.StringIO("not a real file\n")) == [offline.DEMO_QUESTION]

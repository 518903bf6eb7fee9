"""Streaming text deltas: whole UTF-8 characters only, never past a stop string."""

import pytest

from trt_spec.runtime.detokenizer import IncrementalDetokenizer, held_back


class ByteTokenizer:
    """Token id = one UTF-8 byte, decoded as byte-level BPE decodes (bad bytes -> U+FFFD)."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


TEXT = "naïve 日本語 🎉 ok"


def stream_deltas(text, stops=(), final=None):
    ids = list(text.encode("utf-8"))
    d = IncrementalDetokenizer(ByteTokenizer(), stops)
    deltas = []
    for n in range(1, len(ids) + 1):
        d.update(ids[:n])
        deltas.append(d.delta())
    deltas.append(d.flush(text if final is None else final))
    return deltas


def test_multibyte_characters_are_never_split():
    deltas = stream_deltas(TEXT)
    assert "".join(deltas) == TEXT
    assert not any("\ufffd" in x for x in deltas)
    assert "🎉" in deltas  # the 4-byte emoji comes out whole, once its last byte arrived


@pytest.mark.parametrize("text, stops, held", [
    ("abc S", ("STOP",), 1), ("abc ST", ("STOP",), 2), ("abc STO", ("STOP",), 3),
    ("abc", ("STOP",), 0), ("a ab", ("abc", "b"), 2), ("x", ("x",), 0),
])
def test_held_back(text, stops, held):
    assert held_back(text, stops) == held


def test_stream_never_runs_past_a_stop_string():
    full = "hello STOP world"
    final = full[:full.index("STOP")]  # what StopChecker leaves
    ids = list(full.encode("utf-8"))
    d = IncrementalDetokenizer(ByteTokenizer(), ("STOP",))
    sent = ""
    for n in range(1, full.index("STOP") + len("STOP")):  # the last byte ends the stream
        d.update(ids[:n])
        sent += d.delta()
        assert final.startswith(sent), sent  # nothing beyond the cut ever went out
    assert sent == "hello "  # "STO" was being held back
    sent += d.flush(final)
    assert sent == final


def test_false_alarm_is_released():
    """A held-back suffix that does not become a stop string is sent once it cannot."""
    deltas = stream_deltas("a STAR is born", stops=("STOP",))
    assert "".join(deltas) == "a STAR is born"
    assert deltas[:5] == ["a", " ", "", "", "STA"]  # "S", "ST" held until "STA" rules it out

"""The Raft message codec (raftwire.py): every message type pysyncobj and the replica send goes
through msgpack and back unchanged; anything else from outside is one FrameError("message")."""

from __future__ import annotations

import pickle

import msgpack
import pytest
from pysyncobj import pickle as pysyncobj_pickle

from meshjobs import limits, raftwire
from meshjobs.frames import FrameError


def regular(raw: bytes, method: int = 3) -> bytes:
    """A log command as raftwire rebuilds a call of `Replica.apply_entry(raw)`."""
    return bytes([0]) + pickle.dumps((method, (raw,)))


def pysyncobj_regular(raw: bytes, method: int = 3) -> bytes:
    """The same command as pysyncobj's leader logs it (its pickle: protocol 2)."""
    return bytes([0]) + pysyncobj_pickle.dumps((method, (raw,)))


NO_OP = b"\x01"

# Every message type, in the form pysyncobj (or the replica's seam) hands its transport.
MESSAGES = [
    {"type": "append_entries", "term": 4, "commit_index": 9, "prevLogIdx": 9, "prevLogTerm": 3,
     "entries": [(NO_OP, 10, 4), (regular(b"\x81\xa2op\xa1x"), 11, 4), (regular(b""), 12, 4)]},
    {"type": "append_entries", "term": 4, "commit_index": 9, "prevLogIdx": 12, "prevLogTerm": 4,
     "entries": []},  # a heartbeat
    {"type": "append_entries", "term": 4, "commit_index": 9,
     "serialized": (b"MJD1 dump bytes", True, False)},  # a snapshot, a part of it
    {"type": "append_entries", "term": 4, "commit_index": 9, "serialized": None},
    {"type": "next_node_idx", "next_node_idx": 13, "reset": False, "success": True},
    {"type": "request_vote", "term": 5, "last_log_index": 12, "last_log_term": 4},
    {"type": "response_vote", "term": 5},
    {"type": "pre_vote", "term": 5, "last_log_index": 12, "last_log_term": 4},
    {"type": "pre_vote_response", "term": 5, "granted": True},
    {"type": "stale_term", "term": 6},
    {"type": "timeout_now", "term": 6},
    {"type": "apply_command", "command": regular(b"\x80"), "request_id": 7},
    {"type": "apply_command", "command": regular(b"\x80")},
    {"type": "apply_command_response", "request_id": 7, "log_idx": 14, "log_term": 6},
    {"type": "apply_command_response", "request_id": 7, "error": 2},
]


def wire(body: dict) -> object:
    """What the other end unpacks of a frame body (as frames.py does)."""
    return msgpack.unpackb(msgpack.packb(body, use_bin_type=True), raw=False,
                           strict_map_key=False, use_list=True)


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: m["type"])
def test_round_trip_of_every_message_type(message):
    """Rule: decode(encode(m)) is m, as pysyncobj would handle it (entries as tuples)."""
    assert raftwire.decode(wire(raftwire.encode(message))) == message


def test_no_pickle_on_the_wire():
    """Rule 1: an entry leaves as its fields; the receiver rebuilds pysyncobj's command."""
    message = MESSAGES[0]
    packed = msgpack.packb(raftwire.encode(message), use_bin_type=True)
    assert b"\x80\x04\x95" not in packed  # pickle protocol 4's opening
    assert raftwire.decode(wire(raftwire.encode(message)))["entries"][1][0] == regular(
        b"\x81\xa2op\xa1x")


class Boom:
    def __reduce__(self):
        return (print, ("unpickled!",))


GOOD = raftwire.encode(MESSAGES[0])
HOSTILE = [
    ("not a map", [1, 2]),
    ("no type", {"term": 1}),
    ("unknown type", {"type": "install_everything"}),
    ("type not a str", {"type": 5}),
    ("negative term", {"type": "response_vote", "term": -1}),
    ("bool for an int", {"type": "response_vote", "term": True}),
    ("huge int", {"type": "response_vote", "term": 1 << 63}),
    ("extra field", {"type": "response_vote", "term": 1, "x": 1}),
    ("missing field", {"type": "request_vote", "term": 1, "last_log_index": 1}),
    ("int for a bool", {"type": "pre_vote_response", "term": 1, "granted": 1}),
    ("entries not a list", {**GOOD, "entries": {"a": 1}}),
    ("an entry of 3 (pysyncobj's)", {**GOOD, "entries": [[pickle.dumps(Boom()), 10, 4]]}),
    ("a kind we do not send", {**GOOD, "entries": [[10, 4, 2, 0, b""]]}),
    ("a no-op with a payload", {**GOOD, "entries": [[10, 4, 1, 0, b"x"]]}),
    ("a method id too large", {**GOOD, "entries": [[10, 4, 0, 1 << 20, b""]]}),
    ("a payload not bytes", {**GOOD, "entries": [[10, 4, 0, 1, "text"]]}),
    ("a split entry", {**GOOD, "transmission": "start", "data": b"x"}),
    ("no prevLogTerm", {k: v for k, v in GOOD.items() if k != "prevLogTerm"}),
    ("snapshot not a triple", {"type": "append_entries", "term": 1, "commit_index": 1,
                               "serialized": [b"x", True]}),
    ("snapshot plus entries", {"type": "append_entries", "term": 1, "commit_index": 1,
                               "serialized": None, "entries": []}),
    ("a pickled command", {"type": "apply_command", "command": pickle.dumps(Boom())}),
    ("command of a bad kind", {"type": "apply_command", "command": [9, 0, b""]}),
    ("response with both", {"type": "apply_command_response", "request_id": 1, "error": 1,
                            "log_idx": 1, "log_term": 1}),
    ("response error out of range", {"type": "apply_command_response", "request_id": 1,
                                     "error": 99}),
]


@pytest.mark.parametrize("body", [b for _, b in HOSTILE], ids=[n for n, _ in HOSTILE])
def test_hostile_messages_are_one_error_class(body, capsys):
    """Rule 2: a message no member of ours sends is FrameError("message"); nothing in it is
    unpickled."""
    with pytest.raises(FrameError) as e:
        raftwire.decode(wire(body) if not isinstance(body, list) else body)
    assert e.value.reason == "message"
    assert "unpickled!" not in capsys.readouterr().out


def test_too_many_entries_are_refused():
    """Rule 3: at most raft_message_entries_max entries in one message."""
    body = {**GOOD, "entries": [[10, 4, 1, 0, b""]] * (limits.raft_message_entries_max + 1)}
    with pytest.raises(FrameError):
        raftwire.decode(body)


@pytest.mark.parametrize("message", [
    {"type": "append_entries", "term": 1, "commit_index": 1, "prevLogIdx": 1, "prevLogTerm": 1,
     "transmission": "start", "data": b"x"},
    {"type": "append_entries", "term": 1, "commit_index": 1, "prevLogIdx": 1, "prevLogTerm": 1,
     "entries": [(bytes([2]) + pickle.dumps(["add", "x"]), 2, 1)]},
    {"type": "no_such_thing"},
], ids=["split entry", "membership command", "unknown type"])
def test_encoding_what_we_never_send_is_our_bug(message):
    """Rule 2: `encode` of a message our side never sends raises AssertionError."""
    with pytest.raises(AssertionError):
        raftwire.encode(message)


def test_encode_reads_a_logged_pickle_as_plain_data(capsys):
    """Rule 1: a command in the log that is not pysyncobj's exact (method id, (bytes,)) pickle
    (say the entry after a dump a peer sent) is refused: no class or function is looked up."""
    message = {**MESSAGES[0], "entries": [(bytes([0]) + pickle.dumps(Boom()), 10, 4)]}
    with pytest.raises(AssertionError):
        raftwire.encode(message)
    assert "unpickled!" not in capsys.readouterr().out
    big = regular(b"z" * 70_000, method=70_000)  # BININT, BINBYTES, two frames
    body = raftwire.encode({**MESSAGES[0], "entries": [(big, 10, 4)]})
    assert body["entries"] == [[10, 4, 0, 70_000, b"z" * 70_000]]


@pytest.mark.parametrize("raw", [b"", b"\x81\xa2op\xa1x", bytes(range(256)) * 300])
def test_a_command_pysyncobj_pickled_goes_on_the_wire(raw):
    """The leader's own proposals are pickled by pysyncobj (protocol 2, bytes as
    `_codecs.encode(text, "latin1")`): read as plain data, they leave as their fields."""
    message = {**MESSAGES[0], "entries": [(pysyncobj_regular(raw, 5), 10, 4)]}
    got = raftwire.decode(wire(raftwire.encode(message)))
    assert got["entries"] == [(regular(raw, 5), 10, 4)]
    assert pysyncobj_pickle.loads(got["entries"][0][0][1:]) == (5, (raw,))


def test_the_functions_a_logged_pickle_may_name_do_only_what_pysyncobj_needs():
    """Rule 1: `_codecs.encode` only encodes latin1 text; `bytes` only makes empty bytes."""
    bad = bytes([0]) + pickle.dumps((3, (b"x",)), protocol=2).replace(b"latin1", b"zlib_c")
    with pytest.raises(AssertionError):
        raftwire.encode({**MESSAGES[0], "entries": [(bad, 10, 4)]})
    huge = bytes([0]) + pickle.dumps((3, (b"",)), protocol=2).replace(b")R", b"J\xff\xff\xff\x7f\x85R")
    with pytest.raises(AssertionError):  # bytes(2**31 - 1): refused, not allocated
        raftwire.encode({**MESSAGES[0], "entries": [(huge, 10, 4)]})

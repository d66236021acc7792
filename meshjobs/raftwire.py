"""Raft messages on the wire: pysyncobj's message dicts <-> msgpack bodies of F_RAFT frames.

Theory of operation. pysyncobj hands its transport a dict per message (`{"type":
"append_entries", "term": ..., "entries": [(command, idx, term), ...], ...}`); its own TCP
transport pickled it. `raftlink.py` seals each message in an F_RAFT frame of `frames.py` (the
member links' handshake and AEAD, so it is authenticated by the fleet secret and replay-proof),
and this module turns the dict into the frame's body and back. `encode` is given only what our
own pysyncobj and replica send; `decode` is given bytes from outside and checks every field of
every message type against `_SHAPES`, so pysyncobj only ever sees a message of a shape it sends
itself.

Log entries. pysyncobj's log holds a command as bytes: a type byte and, for a regular command,
`pickle.dumps((method id, args))`; our only replicated method takes one msgpack bytes argument
(`Replica.apply_entry`). On the wire an entry is `[idx, term, kind, method id, raw]` with kind 0
(regular, method id and raw are the method's id and its bytes argument) or kind 1 (pysyncobj's
no-op, method id 0, raw empty): no pickle leaves the machine. The receiver rebuilds pysyncobj's
command bytes from these checked fields itself, so the pickle it later loads to apply an entry is
one it wrote. The sender reads the two fields out of its log's pickles as plain data only (no
class or function is looked up, so nothing runs): most were pickled by its own pysyncobj or
rebuilt here, but the entry after a snapshot came in a peer's dump.

Rule 1: pure. No IO, clock, threads or randomness. `pickle` builds the local log's command
        format (decode); `encode` reads a command back with an unpickler that finds no class or
        function, so nothing in it can run: a log may hold an entry that came in a peer's dump.
Rule 2: anything wrong in a message from outside raises `frames.FrameError("message", why)`,
        the one error class of the wire; the caller counts it and closes the connection.
        `encode` given something our side never sends raises AssertionError (a bug of ours).
Rule 3: sizes are bounded by the frame (`raft_message_bytes_max`, checked before the body is
        unpacked); a message carries at most `raft_message_entries_max` entries.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

from meshjobs import limits
from meshjobs.frames import FrameError

_REGULAR = 0  # pysyncobj's _COMMAND_TYPE.REGULAR
_NO_OP = 1  # pysyncobj's _COMMAND_TYPE.NO_OP
_U63 = (1 << 63) - 1
_METHOD_ID_MAX = 1 << 16
# pysyncobj's FAIL_REASON values (apply_command_response's error).
_FAIL_REASONS = range(0, 16)


def _int(v: Any) -> bool:
    return type(v) is int and 0 <= v <= _U63


def _bool(v: Any) -> bool:
    return type(v) is bool


# Each message type: its required fields and their checks. append_entries, apply_command and
# apply_command_response have variants and are checked by their own functions below.
_SHAPES: dict[str, dict[str, Any]] = {
    "next_node_idx": {"next_node_idx": _int, "reset": _bool, "success": _bool},
    "request_vote": {"term": _int, "last_log_index": _int, "last_log_term": _int},
    "pre_vote": {"term": _int, "last_log_index": _int, "last_log_term": _int},
    "response_vote": {"term": _int},
    "pre_vote_response": {"term": _int, "granted": _bool},
    "stale_term": {"term": _int},
    "timeout_now": {"term": _int},
}
TYPES = frozenset(_SHAPES) | {"append_entries", "apply_command", "apply_command_response"}


def _bad(why: str) -> FrameError:
    return FrameError("message", why)


# --- commands: pysyncobj's bytes <-> (kind, method id, raw) -------------------------------------

def _command_out(command: bytes) -> tuple[int, int, bytes]:
    if not isinstance(command, bytes | bytearray) or not command:
        raise AssertionError(f"a log command is bytes, not {type(command).__name__}")
    kind = command[0]
    if kind == _NO_OP and len(command) == 1:
        return _NO_OP, 0, b""
    if kind != _REGULAR:
        raise AssertionError(f"a log command of type {kind}: meshjobs sends regular and no-op only")
    # Read with no globals (rule 1): only ints, bytes and tuples can come out, nothing runs.
    # The entry after a dump came in the dump a peer sent, so it is not ours to unpickle.
    try:
        cmd = _DataOnly(io.BytesIO(command[1:])).load()
    except Exception as e:
        raise AssertionError(f"a regular command that is not plain data: {e}") from None
    if (not isinstance(cmd, tuple) or len(cmd) != 2 or type(cmd[0]) is not int
            or not isinstance(cmd[1], tuple) or len(cmd[1]) != 1
            or not isinstance(cmd[1][0], bytes)):
        raise AssertionError("a regular command is (method id, (bytes,)): see Replica.apply_entry")
    return _REGULAR, cmd[0], cmd[1][0]


def _latin1(text: Any, encoding: Any) -> bytes:
    if not isinstance(text, str) or encoding != "latin1":
        raise pickle.UnpicklingError("_codecs.encode of something other than latin1 text")
    return text.encode("latin1")


def _empty_bytes(*args: Any) -> bytes:
    if args:
        raise pickle.UnpicklingError("bytes() with arguments")
    return b""


class _DataOnly(pickle.Unpickler):
    """An unpickler that finds no class or function but two: a pickle that names any other
    (the only way a pickle runs code) fails to load. pysyncobj pickles with protocol 2, which
    writes bytes as a call of `_codecs.encode(text, "latin1")`, and empty bytes as `bytes()`:
    those calls, and only with those arguments, get stand-ins that do just that."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("_codecs", "encode"):
            return _latin1
        if (module, name) in (("__builtin__", "bytes"), ("builtins", "bytes")):
            return _empty_bytes
        raise pickle.UnpicklingError(f"{module}.{name} is not plain data")


def _command_in(kind: Any, method: Any, raw: Any) -> bytes:
    if kind == _NO_OP and type(kind) is int:
        if method != 0 or raw != b"":
            raise _bad("a no-op entry carries nothing")
        return bytes((_NO_OP,))
    if kind != _REGULAR or type(kind) is not int:
        raise _bad(f"an entry of kind {kind!r}")
    if type(method) is not int or not 0 <= method < _METHOD_ID_MAX:
        raise _bad("an entry's method id is not a small count")
    if not isinstance(raw, bytes) or len(raw) > limits.entry_bytes_max:
        raise _bad(f"an entry's payload is not bytes of at most {limits.entry_bytes_max}")
    return bytes((_REGULAR,)) + pickle.dumps((method, (raw,)))


def _entries_out(entries: Any) -> list[list[Any]]:
    out = []
    for entry in entries:
        command, idx, term = entry
        kind, method, raw = _command_out(command)
        out.append([idx, term, kind, method, raw])
    return out


def _entries_in(raw_entries: Any) -> list[tuple[bytes, int, int]]:
    if not isinstance(raw_entries, list) or len(raw_entries) > limits.raft_message_entries_max:
        raise _bad(f"entries is not a list of at most {limits.raft_message_entries_max}")
    out = []
    for e in raw_entries:
        if not isinstance(e, list) or len(e) != 5:
            raise _bad("an entry is not [idx, term, kind, method, raw]")
        idx, term, kind, method, raw = e
        if not _int(idx) or not _int(term):
            raise _bad("an entry's index or term is not a count")
        out.append((_command_in(kind, method, raw), idx, term))
    return out


# --- messages ------------------------------------------------------------------------------

def encode(message: dict[str, Any]) -> dict[str, Any]:
    """The F_RAFT body of a message our pysyncobj or replica sends."""
    kind = message.get("type")
    if kind == "append_entries":
        if "transmission" in message:
            raise AssertionError("an entry split over messages: appendEntriesBatchSizeBytes is "
                                 "smaller than an entry")
        body = {k: v for k, v in message.items() if k != "entries"}
        if "serialized" in message:
            data = message["serialized"]
            body["serialized"] = None if data is None else [bytes(data[0]), bool(data[1]),
                                                            bool(data[2])]
        else:
            body["entries"] = _entries_out(message.get("entries", ()))
        return body
    if kind == "apply_command":
        k, method, raw = _command_out(message["command"])
        body = {"type": kind, "command": [k, method, raw]}
        if "request_id" in message:
            body["request_id"] = message["request_id"]
        return body
    if kind in TYPES:
        return dict(message)
    raise AssertionError(f"a Raft message of type {kind!r}: add it to raftwire")


def decode(body: Any) -> dict[str, Any]:
    """The message a peer sent, in pysyncobj's form, its shape checked (rule 2)."""
    if not isinstance(body, dict):
        raise _bad("a message is a map")
    kind = body.get("type")
    if not isinstance(kind, str) or kind not in TYPES:
        raise _bad(f"no such message type: {str(kind)[:40]!r}")
    if kind == "append_entries":
        return _append_in(body)
    if kind == "apply_command":
        return _apply_command_in(body)
    if kind == "apply_command_response":
        return _apply_response_in(body)
    shape = _SHAPES[kind]
    if set(body) != set(shape) | {"type"}:
        raise _bad(f"{kind} has fields {sorted(map(str, body))[:8]}")
    for key, check in shape.items():
        if not check(body[key]):
            raise _bad(f"{kind}.{key} is not what it should be")
    return dict(body)


def _append_in(body: dict[Any, Any]) -> dict[str, Any]:
    base = {"type", "term", "commit_index"}
    if not _int(body.get("term")) or not _int(body.get("commit_index")):
        raise _bad("append_entries needs term and commit_index")
    if "serialized" in body:
        if set(body) != base | {"serialized"}:
            raise _bad("a snapshot append_entries has other fields")
        data = body["serialized"]
        if data is not None and not (
                isinstance(data, list) and len(data) == 3 and isinstance(data[0], bytes)
                and _bool(data[1]) and _bool(data[2])):
            raise _bad("serialized is not [bytes, first, last]")
        return {"type": "append_entries", "term": body["term"],
                "commit_index": body["commit_index"],
                "serialized": None if data is None else tuple(data)}
    if set(body) != base | {"prevLogIdx", "prevLogTerm", "entries"}:
        raise _bad("append_entries has other fields")
    if not _int(body["prevLogIdx"]) or not _int(body["prevLogTerm"]):
        raise _bad("append_entries needs prevLogIdx and prevLogTerm")
    return {"type": "append_entries", "term": body["term"], "commit_index": body["commit_index"],
            "entries": _entries_in(body["entries"]), "prevLogIdx": body["prevLogIdx"],
            "prevLogTerm": body["prevLogTerm"]}


def _apply_command_in(body: dict[Any, Any]) -> dict[str, Any]:
    command = body.get("command")
    if (not set(body) <= {"type", "command", "request_id"} or not isinstance(command, list)
            or len(command) != 3):
        raise _bad("apply_command is {command: [kind, method, raw], request_id?}")
    msg: dict[str, Any] = {"type": "apply_command", "command": _command_in(*command)}
    if "request_id" in body:
        if not _int(body["request_id"]):
            raise _bad("apply_command.request_id is not a count")
        msg["request_id"] = body["request_id"]
    return msg


def _apply_response_in(body: dict[Any, Any]) -> dict[str, Any]:
    keys = set(body)
    if not _int(body.get("request_id")):
        raise _bad("apply_command_response.request_id is not a count")
    if keys == {"type", "request_id", "error"}:
        if type(body["error"]) is not int or body["error"] not in _FAIL_REASONS:
            raise _bad("apply_command_response.error is not a reason")
    elif keys == {"type", "request_id", "log_idx", "log_term"}:
        if not _int(body["log_idx"]) or not _int(body["log_term"]):
            raise _bad("apply_command_response's log_idx or log_term is not a count")
    else:
        raise _bad("apply_command_response has other fields")
    return dict(body)

"""A python worker: the process a `python` pool keeps to call `module:function(payload)` per item.

Theory of operation. meshd spawns `python -m meshjobs.pyworker` with pipes on fd 0 and fd 1 and
keeps it for many items. The worker first moves the protocol off the standard descriptors: it
duplicates fd 0 and fd 1 for frames, then points fd 0 at /dev/null and fd 1 at its stderr (the
member's log), so nothing a function prints or writes at the descriptor level can reach the
frames. It then says it is ready (one `{"ready": True}` answer) and serves requests, one at a
time, until its request pipe closes.

Frames, both ways: a 4-byte big-endian length, then that many bytes of msgpack (a map).
- Request: job, index, epoch (the lease), target ("package.module:function"), payload (bytes),
  env (the job's env), cwd (or None), args (the job's argv after the target; [] when none).
- Answer: ok (bool), out (bytes: the function's output), err (bytes: what the function printed,
  then the traceback or the reason the call failed), and on a failure why (str, one line: the
  item's error, `raised ValueError: <message>` when the function raised).

Rules:
1. The function gets the payload as its one positional argument, plus `args=[...]` (a list of
   str) only when the job's argv has more than the target. It returns bytes (or bytearray or
   memoryview), str (encoded UTF-8) or None (empty output); anything else fails the call.
2. During a call, os.environ holds the job's env and MESH_JOB_ID, MESH_ITEM_INDEX and
   MESH_LEASE_EPOCH, over the worker's own environment (the few variables of meshd's that items
   may see, meshjobs.itemenv, not meshd's whole environment); the cwd is the job's cwd when it has one, and that folder is also first on
   sys.path while the target is imported. All of it is put back after the call.
3. sys.stdout and sys.stderr are one capture during a call: the item's stderr is what the
   function printed (at most limits.py_prints_chars_max characters), then the traceback.
4. A module is imported once and each target resolved once per worker: later calls reuse them.
5. An answer whose out and err together pass limits.py_result_bytes_max is replaced by a failure
   that says so. A request larger than the limits allow is a broken invariant of meshd: the
   worker exits with status 70.
6. A worker dies with meshd: before anything else it sets its parent-death signal to SIGKILL
   (after its uid was switched, which would clear it), then checks that meshd is still its
   parent. The signal follows the driver thread that started it, which ends only after it
   killed every worker (meshjobs/driver.py, Rule 11), or with meshd.
"""

from __future__ import annotations

import importlib
import io
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, BinaryIO

import msgpack

from meshjobs import limits

HEADER_BYTES = 4
READY = {"ready": True}


def request_frame_bytes_max() -> int:
    """The largest request frame a worker accepts (payload and fields)."""
    return limits.py_request_bytes_max + limits.py_frame_overhead_bytes_max


def answer_frame_bytes_max() -> int:
    """The largest answer frame meshd accepts from a worker."""
    return limits.py_result_bytes_max + limits.py_frame_overhead_bytes_max


def frame(body: dict[str, Any]) -> bytes:
    """One frame: length, then the msgpack of body."""
    packed = msgpack.packb(body, use_bin_type=True)
    return len(packed).to_bytes(HEADER_BYTES, "big") + packed


class _Capture(io.TextIOBase):
    """sys.stdout and sys.stderr during a call: keeps the first py_prints_chars_max characters."""

    def __init__(self) -> None:
        self._parts: list[str] = []
        self._kept = 0
        self._dropped = 0

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        room = limits.py_prints_chars_max - self._kept
        if room >= len(s):
            self._parts.append(s)
            self._kept += len(s)
        else:
            if room > 0:
                self._parts.append(s[:room])
                self._kept += room
            self._dropped += len(s) - max(room, 0)
        return len(s)

    def text(self) -> str:
        if self._dropped:
            return "".join(self._parts) + f"\n[{self._dropped} more printed characters dropped]\n"
        return "".join(self._parts)


class _CallError(Exception):
    """The call could not be made (bad target, bad cwd); the message says why."""


class Worker:
    """The worker's state: resolved targets, and how to serve one request."""

    def __init__(self) -> None:
        self._targets: dict[str, Callable[..., Any]] = {}

    def resolve(self, target: str, cwd: str | None) -> Callable[..., Any]:
        fn = self._targets.get(target)
        if fn is not None:
            return fn
        mod_name, sep, attr = target.partition(":")
        if not sep or not mod_name or not attr:
            raise _CallError(f"target {target!r} is not 'package.module:function': fix the "
                             f"job's argv[0]")
        added = cwd is not None and cwd not in sys.path
        if added:
            sys.path.insert(0, cwd)  # type: ignore[arg-type]
        try:
            module = importlib.import_module(mod_name)
        except ModuleNotFoundError as e:
            raise _CallError(f"no module {mod_name!r} on this member ({e}): install it, or "
                             f"fix the job's argv[0] or cwd; the pool's workers run as "
                             f"{_whoami()}, which must be able to read it") from e
        except PermissionError as e:
            raise _CallError(f"module {mod_name!r} is not readable by the pool's workers, which "
                             f"run as {_whoami()} ({e.strerror or e}: {e.filename}): make it "
                             f"readable by that user, or set the pool's user") from e
        except BaseException as e:
            raise _CallError(f"module {mod_name!r} failed to import:\n"
                             + "".join(traceback.format_exception(e))) from e
        finally:
            if added:
                sys.path.remove(cwd)  # type: ignore[arg-type]
        obj: Any = module
        for part in attr.split("."):
            try:
                obj = getattr(obj, part)
            except AttributeError:
                raise _CallError(f"module {mod_name!r} has no function {attr!r}: fix the job's "
                                 f"argv[0]") from None
        if not callable(obj):
            raise _CallError(f"{target!r} is a {type(obj).__name__}, not a function: fix the "
                             f"job's argv[0]")
        self._targets[target] = obj
        return obj

    def serve(self, req: dict[str, Any]) -> dict[str, Any]:
        """Make one call; the answer to send."""
        env = {str(k): str(v) for k, v in (req.get("env") or {}).items()}
        env["MESH_JOB_ID"] = str(req["job"])
        env["MESH_ITEM_INDEX"] = str(req["index"])
        env["MESH_LEASE_EPOCH"] = str(req["epoch"])
        saved_env = {k: os.environ.get(k) for k in env}
        cwd = req.get("cwd")
        saved_cwd = os.getcwd() if cwd is not None else None
        capture = _Capture()
        saved_out, saved_err = sys.stdout, sys.stderr
        ok = False
        out = b""
        tail = ""
        why = ""  # one line for the item's record: what the call ended with
        try:
            os.environ.update(env)
            if cwd is not None:
                try:
                    os.chdir(cwd)
                except OSError as e:
                    raise _CallError(f"working directory {cwd!r} is not usable on member "
                                     f"({e.strerror or e}): create it or fix the job's cwd") from e
            sys.stdout = sys.stderr = capture
            fn = self.resolve(req["target"], cwd)
            args = req.get("args") or []
            try:
                result = fn(req["payload"], args=args) if args else fn(req["payload"])
            except BaseException as e:  # the function's own failure, SystemExit included
                # The worker's own frame is left out: the traceback starts in the job's code.
                tail = "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next
                                                          if e.__traceback__ else None))
                # The exception's last line, as the traceback ends: "raised ValueError: bad".
                last = traceback.format_exception_only(type(e), e)[-1].strip()
                why = f"raised {last}"
            else:
                if result is None:
                    out, ok = b"", True
                elif isinstance(result, str):
                    out, ok = result.encode("utf-8", "surrogateescape"), True
                elif isinstance(result, (bytes, bytearray, memoryview)):
                    out, ok = bytes(result), True
                else:
                    tail = (f"{req['target']} returned {type(result).__name__}: return bytes, "
                            f"str or None\n")
                    why = tail.strip()
        except _CallError as e:
            tail = str(e) + "\n"
            why = str(e).split("\n", 1)[0]
        finally:
            sys.stdout, sys.stderr = saved_out, saved_err
            if saved_cwd is not None:
                try:
                    os.chdir(saved_cwd)
                except OSError:
                    os.chdir("/")  # the folder we started in went away; any folder will do
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        err = (capture.text() + tail).encode("utf-8", "surrogateescape")
        if len(out) + len(err) > limits.py_result_bytes_max:
            what = "output" if len(out) > len(err) else "printed text"
            msg = (f"{req['target']} gave {len(out)} bytes of output and {len(err)} bytes of "
                   f"stderr, over the limit of {limits.py_result_bytes_max} bytes "
                   f"(py_result_bytes_max, mostly {what}): return less, or store large results "
                   f"elsewhere\n")
            return {"ok": False, "out": b"", "err": msg.encode(), "why": msg.strip()}
        answer: dict[str, Any] = {"ok": ok, "out": out, "err": err}
        if not ok and why:
            answer["why"] = why[:limits.item_error_chars_max]
        return answer


def _whoami() -> str:
    """This worker's user, as errors name it: "user NAME (uid N)"."""
    import pwd
    uid = os.getuid()
    try:
        return f"user {pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _read_exact(f: BinaryIO, n: int) -> bytes | None:
    data = f.read(n)
    if not data:
        return None
    if len(data) != n:
        raise EOFError(f"request cut short: {len(data)} of {n} bytes")
    return data


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


_PR_SET_PDEATHSIG = 1  # prctl(2)


def die_with(parent: int) -> None:
    """Be killed (SIGKILL) when the thread that started this process ends, and exit now if
    `parent` (meshd's pid) is not this process's parent any more: it died before the signal was
    set (Rule 6). Where there is no prctl (not Linux), nothing."""
    try:
        import ctypes
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    prctl(_PR_SET_PDEATHSIG, 9, 0, 0, 0)  # SIGKILL
    if os.getppid() != parent:
        os._exit(70)


def main() -> None:
    """Serve requests on fd 0, answers on fd 1, until the request pipe closes. argv[1], when
    given, is the pid of the meshd that started this worker (`die_with`)."""
    if len(sys.argv) > 1 and sys.argv[1].isdigit():
        die_with(int(sys.argv[1]))
    req_fd = os.dup(0)
    ans_fd = os.dup(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    requests = open(req_fd, "rb", buffering=1 << 16)  # noqa: SIM115 (lives as long as the worker)
    worker = Worker()
    limit = request_frame_bytes_max()
    _write_all(ans_fd, frame(READY))
    while True:
        head = _read_exact(requests, HEADER_BYTES)
        if head is None:
            return  # meshd closed the pipe: the pool is stopping
        n = int.from_bytes(head, "big")
        if n > limit:
            print(f"pyworker: request of {n} bytes is over {limit}", file=sys.__stderr__)
            os._exit(70)
        body = _read_exact(requests, n)
        if body is None:
            raise EOFError("request cut short")
        req = msgpack.unpackb(body, raw=False)
        _write_all(ans_fd, frame(worker.serve(req)))


if __name__ == "__main__":
    main()

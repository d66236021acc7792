"""meshd: one member of a meshjobs fleet. The only module that starts threads.

With no arguments it runs a fleet of one: data folder `./meshjobs-data`, HTTP on 127.0.0.1:7700,
Raft on 127.0.0.1:7702, a `default` pool of kind `command` with one slot per core. `--config FILE`
takes the TOML keys of docs/configuration.md. SIGTERM or SIGINT stops it cleanly (exit 0): running items are
cut, and their leases are revoked and re-leased when the member starts again.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import random
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import structlog

import meshjobs
from meshjobs import datadir, limits, logs, ports, sdnotify
from meshjobs.config import Config, ConfigError, load_config, parse_addr, python_workers
from meshjobs.dumpfile import DumpCorrupt
from meshjobs.failpoints import Failpoints
from meshjobs.journal import JournalCorrupt
from meshjobs.node import BlobsCopied, DiskFull, JobNode, NodeConfig, Pressure
from meshjobs.node.events import MEMBER_OWNER
from meshjobs.table import JobTable

log = structlog.get_logger("meshd")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="meshd",
        description="Run one member of a meshjobs fleet (with no arguments: a fleet of one).")
    p.add_argument("--config", metavar="FILE", help="TOML config file (see docs/operating.md)")
    p.add_argument("--name", help="member name (overrides the config)")
    p.add_argument("--data", metavar="DIR", help="data folder (overrides the config)")
    p.add_argument("--http", metavar="HOST:PORT", help="HTTP address (port 0: any free port)")
    p.add_argument("--raft", metavar="HOST:PORT", help="Raft address")
    p.add_argument("--peer", metavar="HOST:PORT", help="member links address")
    p.add_argument("--slots", type=int, metavar="N",
                   help="slots of the default pool (when the config names no pools)")
    p.add_argument("--log-level", default=None, help="debug, info, warning or error")
    p.add_argument("--demo", action="store_true",
                   help="start a throw-away fleet of one, run a few jobs through it, show them, stop")
    p.add_argument("--version", action="version", version=f"meshd, version {meshjobs.version()}",
                   help="print meshd's version and exit")
    # Shown as optional: with no command, meshd runs the member.
    sub = p.add_subparsers(dest="command", metavar="[COMMAND]", title="commands")
    check = sub.add_parser(
        "check-config", help="check a config file as meshd would load it, without starting: "
        "every problem at once (exit 2), or a summary (exit 0)")
    check.add_argument("file", metavar="FILE", help="the TOML config file to check")
    secret = sub.add_parser(
        "new-secret", help="write a new fleet secret (32 random bytes, mode 0600) to PATH for "
        "the first member of a new fleet, then copy it to the others; never overwrites a file")
    secret.add_argument("path", metavar="PATH", help="where to write it (e.g. DATA/fleet.secret)")
    return p.parse_args(argv)


def _new_secret(path: str) -> int:
    """`meshd new-secret PATH`: 0 when written, 2 when PATH exists or cannot be written."""
    from meshjobs.replica import new_secret

    datadir.private_umask()
    try:
        new_secret(path)
    except FileExistsError:
        print(f"meshd: {path} exists already: not overwritten (a member's secret must stay the "
              "fleet's; to replace it, stop every member, remove the file, and make one new "
              "secret for all)", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"meshd: cannot write a fleet secret at {path}: {e.strerror or e} (does its "
              "folder exist, and may meshd's user write there?)", file=sys.stderr)
        return 2
    print(f"meshd: wrote a new fleet secret to {path} (mode 0600): copy this file to every "
          "member of the fleet, as its secret_file", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    if args.command == "check-config":
        from meshjobs.checkconfig import check_config
        sys.exit(check_config(args.file))
    if args.command == "new-secret":
        sys.exit(_new_secret(args.path))
    if args.demo:
        from meshjobs.demo import run_demo
        sys.exit(run_demo())
    # Before anything is created: what meshd makes is its own alone (meshjobs/datadir.py).
    datadir.private_umask()
    # Before any thread starts (every thread takes this one's mask, and the items they start):
    # a signal blocked by whoever started meshd is not blocked here. SIGTERM must reach meshd.
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    # Before any item or worker starts: capabilities given to meshd stay meshd's (runas).
    from meshjobs import runas
    runas.keep_capabilities_to_self()
    logs.configure(args.log_level)
    try:
        cfg = load_config(args.config, {"name": args.name, "data": args.data, "http": args.http,
                                        "raft": args.raft, "peer": args.peer})
        if args.slots is not None:
            if args.slots < 0 or "default" not in cfg.pools:
                raise ConfigError("--slots needs a default pool and a count of 0 or more")
            cfg.pools["default"].slots = args.slots
        _check_pool_users(cfg)
        _check_item_user(cfg)
    except ConfigError as e:
        print(f"meshd: {e}", file=sys.stderr)
        sys.exit(2)
    # The jobs thread makes and drops many small objects per item (events, effects, futures);
    # a deeper first generation keeps the collector from rescanning them thousands of times a
    # second (measured in bench/blobs.py: about a fifth of a small put's cost).
    gc.set_threshold(20_000, 50, 50)
    sys.exit(Member(cfg).serve())


def _check_pool_users(cfg: Config) -> None:
    """A pool's default user ([pools.X] user) this member cannot run items as stops it at start
    (config.py checked that the user exists)."""
    from meshjobs import runas
    may_switch = runas.can_switch_user()
    for pool in cfg.pools.values():
        if pool.user is None:
            continue
        ident = runas.resolve(pool.user, cfg.name)
        why = runas.refusal(pool.user, ident, cfg.name, may_switch, os.geteuid(), os.getegid())
        if why is not None:
            raise ConfigError(f"[pools.{pool.name}] user = {pool.user!r}: {why.split(': ', 1)[0]}:"
                              " start meshd as root, or remove the key (items then run as "
                              "meshd's own user)")


def _check_item_user(cfg: Config) -> None:
    """A member that may switch users runs items no job or pool names a user for as its item
    user ([items] user, else meshjobs-item, else nobody): it stops at start when there is none.
    Items that would run as meshd's own uid are said loudly (an explicit [items] user only)."""
    from meshjobs import runas
    if not runas.can_switch_user():
        return
    user = runas.item_user(cfg.item_user)
    if user is None:
        raise ConfigError(f"[items] user: this machine has neither user {runas.ITEM_USER} nor "
                          f"{runas.ITEM_USER_FALLBACK}, and meshd never runs items as its own "
                          f"uid: create {runas.ITEM_USER} (deploy/sysusers.d/meshjobs.conf), or "
                          "set [items] user")
    try:
        ident = runas.resolve(user, cfg.name)
    except runas.RunAsError as e:
        raise ConfigError(f"[items] user = {user!r}: {e.message}") from None
    if ident.uid == os.geteuid():
        log.warning("items_run_as_meshd", user=user, uid=ident.uid,
                    why="[items] user names meshd's own user: items can read its data folder, "
                        "its secret and its /proc files, and signal it; name another user")


def _inherited_ignores() -> list[int]:
    """The signals this process was started with ignored, but those Python itself ignores
    (SIGPIPE, SIGXFSZ: Popen's restore_signals and meshjobs.spawn reset them for items)."""
    own = {getattr(signal, n) for n in ("SIGPIPE", "SIGXFZ", "SIGXFSZ") if hasattr(signal, n)}
    out = []
    for sig in range(1, signal.NSIG):
        if sig in own or sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            if signal.getsignal(sig) == signal.SIG_IGN:
                out.append(sig)
        except (OSError, ValueError):
            continue
    return out


def _ignore(_signum: int, _frame: object) -> None:
    """A signal meshd was started with ignored (`_inherited_ignores`)."""


class Member:
    """All the parts of one meshd, wired together."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    def serve(self) -> int:
        """Run the member until SIGTERM, SIGINT or a stop order; its exit status. The steps, in
        order: open what is on disk (TLS, the data folder's lock and what an earlier run left
        running, secret, disk watch, voters to join, blob store), build
        the node and its replica, build the parts around them, start the threads, write the
        address files, wait, shut down. A step that cannot start the member says why on stderr
        and gives the exit status (`_StartFailed`)."""
        try:
            self._wall_items()
            self._open_tls()
            self._end_leftovers()
            self._open_secret()
            self._watch_disk()
            self._find_voters()
            self._open_blobs()
            self._build_node()
            self._build_replica()
            self._build_parts()
        except _StartFailed as e:
            return e.code
        self._say_walls()
        self._start_threads()
        code = self._write_addr_files()
        if code == 0:
            # systemd (Type=notify): the member serves now.
            sdnotify.notify(
                f"READY=1\nSTATUS=serving HTTP on {self.cfg.http[0]}:{self.http.bound_port}")
            self._wait()
        self._shut_down()
        return code

    # --- the steps of `serve` --------------------------------------------------------------------

    def _wall_items(self) -> None:
        """meshd non-dumpable (its /proc files root's), and the walls its items get
        (meshjobs.wall): `self.walls`, said at start when they do not hold; exit 2 when
        [items] wall = "landlock" and the kernel has no Landlock."""
        from meshjobs import runas, wall
        undumpable = wall.make_undumpable()
        abi = wall.landlock_abi()
        mode = self.cfg.item_wall
        if mode == "landlock" and abi == 0:
            print("meshd: [items] wall = \"landlock\", but this kernel has no Landlock "
                  "(Linux 5.13+ with landlock in lsm=): use a kernel that has it, or set "
                  "[items] wall = \"auto\"", file=sys.stderr)
            raise _StartFailed(2)
        may_switch = runas.can_switch_user()
        # Who items run as when their job and pool name nobody: the item user where meshd may
        # switch users, else meshd's own.
        default_user = (runas.item_user(self.cfg.item_user) if may_switch else None) or _own_user()
        self.walls = wall.status(mode, abi, may_switch, default_user, self.cfg.data,
                                 undumpable=undumpable)
        self.wall_denied = self.cfg.wall_denied if "landlock" in self.walls.walls else None

    def _say_walls(self) -> None:
        """Say what walls items get, once every step that can stop the start has passed (a
        member that does not start says only why)."""
        from meshjobs import wall
        if self.walls.warning is not None:
            log.warning("items_not_walled", member=self.cfg.name, why=self.walls.warning)
            return
        log.info("items_walled", walls=list(self.walls.walls), landlock_abi=self.walls.abi)
        if self.wall_denied is not None:
            try:
                wall.rules(self.wall_denied).check()
            except wall.WallError as e:
                log.error("items_cannot_be_walled", member=self.cfg.name, why=str(e))

    def _start_failed(self, why: str, exc: BaseException) -> _StartFailed:
        """A disk that fails at start stops the member as it would later: the fail-stop
        message (ENOSPC named when that is what it is) and its exit code, no traceback."""
        from meshjobs.diskspace import describe
        from meshjobs.replica import fail_stop

        codes: list[int] = []
        fail_stop(log, why, exc, exit_fn=codes.append, path=self.cfg.data)
        print(f"meshd: {why}: {describe(exc, self.cfg.data)}", file=sys.stderr)
        return _StartFailed(codes[0])

    def _listen_failed(self, part: str, addr: tuple[str, int], exc: BaseException | None) -> int:
        """A listener that cannot bind (`ports.refusal`): a log line and a line on stderr
        naming the address and what to do; meshd's exit status for it."""
        why = ports.refusal(part, addr[0], addr[1], exc)
        log.error("listen_failed", part=part, addr=ports.where(*addr), error=why)
        print(f"meshd: {why}", file=sys.stderr)
        return ports.EXIT_CODE

    def _open_tls(self) -> None:
        """The HTTPS context, when the config names a certificate and key (exit 2 if they do
        not load); then the data folder and the failpoints of the environment."""
        from meshjobs.http import TlsError, tls_context

        cfg = self.cfg
        self.tls = None
        if cfg.http_tls_cert is not None and cfg.http_tls_key is not None:
            try:
                self.tls = tls_context(cfg.http_tls_cert, cfg.http_tls_key)
            except TlsError as e:
                print(f"meshd: {e}", file=sys.stderr)
                raise _StartFailed(2) from None
        datadir.make_folder(cfg.data)
        try:
            datadir.secure(cfg.data, log, skip=(cfg.secret_path,))
        except (datadir.DataFolderError, OSError) as e:
            print(f"meshd: {e}", file=sys.stderr)
            raise _StartFailed(2) from None
        self.failpoints = Failpoints.from_env()

    def _end_leftovers(self) -> None:
        """This member holds its data folder (exit 2 when another meshd does), and ends what an
        earlier run of it left running (meshjobs/leftovers.py) before anything of its own
        starts: no lease is taken, no item started, before they are gone. `self.running` is
        this run's record of the processes it starts."""
        from meshjobs import leftovers

        cfg = self.cfg
        try:
            self.data_lock = datadir.lock(cfg.data)
        except datadir.DataFolderError as e:
            print(f"meshd: {e}", file=sys.stderr)
            raise _StartFailed(2) from None
        except OSError as e:
            raise self._start_failed("the data folder's lock could not be taken", e) from None
        try:
            leftovers.sweep(cfg.data, log)
            self.running = leftovers.Record(cfg.data, self.failpoints)
        except OSError as e:
            raise self._start_failed("the record of running items could not be read or "
                                     "cleared", e) from None

    def _open_secret(self) -> None:
        """The fleet secret (made here for a fleet of one); exit 2 if it is missing or open to
        others, the disk's code if it cannot be written."""
        from meshjobs.replica import open_secret

        try:
            self.secret = open_secret(self.cfg.secret_path, create=self.cfg.fleet_of_one,
                                      failpoints=self.failpoints)
        except SystemExit as e:
            print(e, file=sys.stderr)
            raise _StartFailed(2) from None
        except OSError as e:
            raise self._start_failed("the fleet secret could not be written", e) from None

    def _watch_disk(self) -> None:
        """Free space, looked at before anything is written: on a full disk the reserve file is
        deleted first, so that the journal has room, and the member starts read-only."""
        from meshjobs.diskspace import DiskWatch, default_free_min

        cfg = self.cfg
        self.jobs = None
        self.watch = DiskWatch(
            cfg.data,
            cfg.disk_free_min_bytes if cfg.disk_free_min_bytes is not None
            else default_free_min(cfg.data),
            self.failpoints,
            on_report=lambda full, free: (self.jobs.event(DiskFull(full, free)) if self.jobs
                                          else None))
        self.watch.check()
        self.boot = uuid.uuid4().hex[:12]

    def _find_voters(self) -> None:
        """The fleet's voters: the config's, or for a worker with none, those of the member it
        joins through (tried for `join_s_max`; exit 4 if it cannot be reached)."""
        cfg = self.cfg
        self.voter_peers = voter_peers = {v.name: v.peer for v in cfg.voters}
        if cfg.role == "worker" and not voter_peers:
            from meshjobs.links import discover
            assert cfg.join is not None
            deadline = time.monotonic() + limits.join_s_max
            found, err = None, None
            while found is None and time.monotonic() < deadline:
                try:
                    found = discover(cfg.join, cfg.name, self.boot, self.secret)
                except Exception as e:  # not up yet, or not a member of this fleet
                    err = e
                    log.info("join_retry", join=f"{cfg.join[0]}:{cfg.join[1]}", error=str(e))
                    time.sleep(limits.join_retry_s)
            if found is None:
                print(f"meshd: cannot join the fleet at {cfg.join[0]}:{cfg.join[1]}: {err} (is a "
                      "member running there, and is this member's fleet secret the fleet's?)",
                      file=sys.stderr)
                raise _StartFailed(4)
            for name, addr in found["voters"].items():
                voter_peers[name] = parse_addr(addr, "voter")
            log.info("joined", via=f"{cfg.join[0]}:{cfg.join[1]}", voters=sorted(voter_peers))

    def _open_blobs(self) -> None:
        """The blob store, with the empty payload in it, pinned for good: empty outputs and
        stdins need no write or copy. Written only when missing: on a full disk any write may
        fail (then the member starts read-only)."""
        from blobstore.digest import EMPTY_DIGEST
        from blobstore.store import LmdbBlobStore
        from meshjobs.diskspace import is_disk_error, is_full

        cfg = self.cfg
        try:
            blobs = self.blobs = LmdbBlobStore(os.path.join(cfg.data, "blobs"),
                                               failpoints=self.failpoints)
        except Exception as e:
            if not is_disk_error(e):
                raise
            raise self._start_failed("the blob store could not be opened", e) from None
        try:
            if not blobs.has(EMPTY_DIGEST):
                blobs.put(b"")
            if not blobs.has_pin(EMPTY_DIGEST, MEMBER_OWNER):
                blobs.pin(EMPTY_DIGEST, MEMBER_OWNER)
        except Exception as e:
            if not is_disk_error(e):
                raise
            if not is_full(e, cfg.data) or blobs.poisoned:
                blobs.close()
                raise self._start_failed("the blob store could not be written", e) from None
            self.watch.write_failed(e)  # the disk is full: start read-only

    def _build_node(self) -> None:
        """The job table (its forgotten jobs going to the history) and the job node."""
        from meshjobs.history import History

        cfg = self.cfg
        self.table = table = JobTable()
        self.history = History(cfg.data, cfg.name, cfg.history_bytes_max, cfg.history_keep,
                               log=log)
        table.on_forget = self.history.offer
        self.node = JobNode(table, NodeConfig(
            member=cfg.name, boot=self.boot, pools=cfg.pools, keep_s=cfg.keep_s,
            keep_jobs=cfg.keep_jobs, role=cfg.role, voters=tuple(sorted(self.voter_peers)),
            dead_ms=cfg.dead_ms, lost_ms=cfg.lost_ms, blob_copies=cfg.blob_copies,
            items=self.walls.fleet_entry()),
            random.Random())

    def _build_replica(self) -> None:
        """A voter's Raft replica over its journal (exit 70 if the journal is damaged, 2 if the
        Raft port is taken, the disk's code if it fails); a worker's stand-in."""
        from meshjobs.diskspace import is_disk_error
        from meshjobs.replica import Replica, WorkerReplica

        cfg, blobs = self.cfg, self.blobs
        if cfg.role == "voter":
            partners = [v.raft_addr for v in cfg.voters if v.name != cfg.name]
            names = {v.raft_addr: v.name for v in cfg.voters}
            names[cfg.raft_addr] = cfg.name
            try:
                self.replica = Replica(cfg.raft_addr, partners, cfg.data, self.secret, self.table,
                                       self.failpoints, names=names,
                                       election_s=(limits.raft_election_alone_s if not partners
                                                   else limits.raft_election_s))
            except (JournalCorrupt, DumpCorrupt) as e:
                log.critical("journal_damaged", error=str(e))
                print(f"meshd: {e}", file=sys.stderr)
                blobs.close()
                raise _StartFailed(70) from None
            except Exception as e:  # pysyncobj says BindError when the Raft port is taken
                if is_disk_error(e):
                    blobs.close()
                    raise self._start_failed("the journal could not be opened or written",
                                             e) from None
                if "BindError" in repr(e):
                    code = self._listen_failed("raft", cfg.raft, e)
                    blobs.close()
                    raise _StartFailed(code) from None
                raise
        else:
            self.replica = WorkerReplica()
        # The node knows before its first step whether the disk is full (then it takes no
        # leases: with outputs pending, items re-leased at start would only fail-stop).
        self.node.step(DiskFull(self.watch.full, self.watch.free))

    def _fatal(self, exc: BaseException) -> None:
        from meshjobs.replica import fail_stop

        fail_stop(log, "the blob store could not store outputs", exc, path=self.cfg.data)

    def _build_parts(self) -> None:
        """The parts around the node: blob writers, driver, member links and blob mover (in a
        fleet of more than one), the jobs thread, item logs, timings, HTTP."""
        from blobstore import BlobWriters
        from meshjobs import outpaths, runas
        from meshjobs.driver import Driver
        from meshjobs.hookaddr import NotifyPolicy
        from meshjobs.http import HttpApi
        from meshjobs.itemlogs import ItemLogs
        from meshjobs.jobsd import JobsThread
        from meshjobs.metrics import MemberMetrics

        cfg, blobs, watch, voter_peers = self.cfg, self.blobs, self.watch, self.voter_peers
        outpaths.protect((cfg.data,))  # no --stdout/--stderr path leads into meshd's own files
        self.writers = writers = BlobWriters(blobs, cfg.blob_mem_max_bytes,
                                             on_pressure=lambda on: self.jobs.event(Pressure(on)))
        self.driver = driver = Driver(
            blobs, os.path.join(cfg.data, "spool"),
            on_end=lambda end: self.jobs.item_ended(end), writers=writers, on_fatal=self._fatal,
            python_workers=python_workers(cfg.pools), env_pass=cfg.item_env_pass,
            member=cfg.name, item_user=runas.item_user(cfg.item_user),
            python_pools={p.name: (p.slots, p.user) for p in cfg.pools.values()
                          if p.kind == "python"},
            wall_denied=self.wall_denied, record=self.running)
        links = mover = None
        if not cfg.fleet_of_one:
            from meshjobs.blobmover import BlobMover
            from meshjobs.links import Links
            try:
                links = Links(cfg.name, self.boot, cfg.peer, self.secret,
                              on_frame=lambda peer, frame: self.jobs.frame_in(peer, frame),
                              on_peer=lambda peer, up, hello: self.jobs.peer_changed(peer, up,
                                                                                    hello),
                              discovery=lambda: {n: f"{a[0]}:{a[1]}"
                                                 for n, a in voter_peers.items()})
            except OSError as e:
                code = self._listen_failed("peer", cfg.peer, e)
                self.replica.journal_sync()
                self.replica.close()
                blobs.close()
                raise _StartFailed(code) from None
            for name, addr in voter_peers.items():
                if name != cfg.name:
                    links.connect(name, addr)
            # Copies from peers are refused (not stored, so not acknowledged: the peer asks
            # another member) while the disk is full, like submits.
            mover_blobs = _HttpBlobs(blobs, None, self._fatal, watch)
            mover = BlobMover(cfg.name, mover_blobs, links, os.path.join(cfg.data, "spool-copies"),
                              on_copied=lambda member, digests: self.jobs.event(
                                  BlobsCopied(member, tuple(digests))))
        self.links, self.mover = links, mover
        self.jobs = jobs = JobsThread(self.node, self.replica, driver, blobs, links=links,
                                      mover=mover)
        jobs.writers = writers
        self.item_logs = item_logs = jobs.logs = ItemLogs(cfg.name, driver, links)
        timings = jobs.timings = MemberMetrics()
        http_blobs = _HttpBlobs(blobs, mover, self._fatal, watch)
        self.http = http = HttpApi(
            cfg.http[0], cfg.http[1], jobs, http_blobs, cfg.name, tls=self.tls,
            names=(*cfg.http_names, *(v.http[0] for v in cfg.voters if v.http)),
            auth=cfg.auth, conns_max=cfg.http_conns_max,
            header_timeout_s=cfg.http_header_timeout_s,
            idle_timeout_s=cfg.http_idle_timeout_s,
            body_timeout_s=cfg.http_body_timeout_s, timings=timings,
            item_logs=item_logs,
            # Alone, this member is the one that would run the job: it can tell now.
            user_check=driver.check_user if cfg.fleet_of_one else None,
            notify_policy=NotifyPolicy.parse(cfg.notify_allow))
        http.history = jobs.history = self.history

    def _start_threads(self) -> None:
        """Signals and stop orders set `stop`; every part's thread starts, guarded: a thread
        that raises or ends before the stop stops the member (exit 70, or the disk's code)."""
        from meshjobs.diskspace import is_disk_error
        from meshjobs.hookaddr import NotifyPolicy
        from meshjobs.notify import Notifier
        from meshjobs.replica import fail_stop

        cfg, jobs = self.cfg, self.jobs
        self.stop = stop = threading.Event()

        def on_signal(signum, _frame):
            log.info("signal", signal=signal.Signals(signum).name)
            stop.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        # Signals meshd was started with ignored (SIGHUP under nohup, SIGQUIT in a background
        # job) stay ignored for meshd, as a handler that does nothing: a handled signal is back
        # at its default in every program meshd starts, where an ignored one stays ignored.
        for sig in _inherited_ignores():
            with contextlib.suppress(OSError, ValueError):
                signal.signal(sig, _ignore)

        def on_stop_order(why: str) -> None:
            # `meshctl member stop`: the same clean stop as SIGTERM, exit status 0.
            log.info("meshd_stopping_by_order", why=why)
            stop.set()

        jobs.on_exit = on_stop_order
        self.notifier = notifier = jobs.notifier = Notifier(
            cfg.name, policy=NotifyPolicy.parse(cfg.notify_allow))

        def guarded(name, body):
            def target():
                try:
                    body()
                except BaseException as exc:
                    if name == "http" and self._http_bind_error() is exc:
                        return  # the main thread says so and stops (_write_addr_files)
                    if is_disk_error(exc):  # the disk's code and message, as everywhere
                        fail_stop(log, f"the {name} thread stopped on an error", exc,
                                  path=cfg.data)
                    log.exception("thread_crashed", thread=name)
                    os._exit(70)
                if not stop.is_set():
                    log.critical("thread_ended", thread=name)
                    os._exit(70)
            return threading.Thread(target=target, name=name, daemon=True)

        self.t_jobs = guarded("jobs", jobs.run)
        self.t_driver = guarded("driver", self.driver.run)
        self.extra = extra = self._part_threads(guarded, notifier)
        for t in extra:
            t.start()
        self.http_ready = http_ready = threading.Event()
        self.t_http = guarded("http", lambda: self.http.run(http_ready))
        self.t_driver.start()
        self.t_jobs.start()
        self.t_http.start()

    def _part_threads(self, guarded: Callable[[str, Callable[[], Any]], threading.Thread],
                      notifier: Any) -> list[threading.Thread]:
        """The threads of the parts beside the jobs, driver and HTTP ones, not started yet:
        blob writers, links, blob mover, item logs, the dump sender, history, notify senders
        and systemd's watchdog; each `guarded` (a crash stops the member)."""
        jobs = self.jobs
        extra = [guarded(f"blob-{name}", body) for name, body in self.writers.targets()]
        if self.links is not None:
            extra.append(guarded("links", self.links.run))
        if self.mover is not None:
            extra.append(guarded("blobmover", self.mover.run))
        if self.links is not None:
            extra.append(guarded("itemlogs", self.item_logs.run))
        self.dump_sender = None
        if self.links is not None and getattr(self.replica, "dump_path", None) is not None:
            # Whole tables for new workers: the dump file, sent off the jobs thread.
            from meshjobs.dumpsend import DumpSender
            self.dump_sender = jobs.dump_sender = DumpSender(self.links, self.replica.dump_path)
            extra.append(guarded("dumpsend", self.dump_sender.run))
        extra.append(guarded("history", self.history.run))
        # Finish notices: several senders, so that one slow receiver delays no other.
        extra.extend(guarded(f"notify-{i}", notifier.run) for i in range(limits.notify_senders_max))
        # systemd's watchdog (WatchdogSec=): pinged while the jobs thread answers.
        self.watchdog = None
        period_s = sdnotify.watchdog_period_s()
        if period_s is not None:
            self.watchdog = sdnotify.Watchdog(period_s, self._jobs_answer)
            extra.append(guarded("watchdog", self.watchdog.run))
        return extra

    def _jobs_answer(self, timeout_s: float) -> bool:
        """Whether the jobs thread answers a health request within `timeout_s` (the watchdog's
        test of life: a stuck or dead jobs thread answers nothing)."""
        import concurrent.futures

        try:
            self.jobs.call({"op": "health"}).result(timeout_s)
        except concurrent.futures.TimeoutError:
            return False
        return True

    def _http_bind_error(self) -> BaseException | None:
        """What kept HTTP from listening (an OSError of its bind), if that is why it stopped."""
        error = self.http.error
        if isinstance(error, OSError) and not self.http.bound_port:
            return error
        return None

    def _write_addr_files(self) -> int:
        """Once HTTP listens (exit 2 if it does not within `http_start_s_max`): its address in
        `http.addr` in the data folder, and the ready line in the log; 0. If HTTP cannot listen
        (its port taken): nothing written as ready, the reason said, and the exit status."""
        cfg, http = self.cfg, self.http
        if not self.http_ready.wait(limits.http_start_s_max):
            print(f"meshd: HTTP did not start on {cfg.http[0]}:{cfg.http[1]}", file=sys.stderr)
            os._exit(2)
        error = self._http_bind_error()
        if error is not None:
            self.stop.set()  # the threads end now without that stopping the member (exit 70)
            return self._listen_failed("http", cfg.http, error)
        addr = f"{cfg.http[0]}:{http.bound_port}"
        # http.addr is host:port for HTTP (as before), the whole URL for HTTPS.
        try:
            _write_file(os.path.join(cfg.data, "http.addr"),
                        (f"https://{addr}" if self.tls is not None else addr) + "\n")
        except OSError as e:
            # The last write of a start (a worker's only one): on a disk with no room left, or
            # one that fails, the member stops as a failed write stops it anywhere, at once
            # (its threads run): the disk's message and exit code, no traceback.
            from meshjobs.diskspace import EXIT_DISK

            code = EXIT_DISK  # (also when saying so fails: stderr may be on that disk)
            try:
                code = self._start_failed("the HTTP address could not be written to http.addr",
                                          e).code
            finally:
                os._exit(code)
        log.info("meshd_ready", member=cfg.name, http=f"{http.scheme}://{addr}", raft=cfg.raft_addr,
                 data=cfg.data, pools={p.name: p.slots for p in cfg.pools.values()},
                 boot=self.boot, items_run_as=self.driver.items_run_as())
        return 0

    def _wait(self) -> None:
        """The main thread's own work while it waits for the stop: collecting blobs whose pins
        are all gone (forgotten jobs), once the grace period has passed; and polling free
        space: below disk_free_min the member turns read-only, and back."""
        from meshjobs.diskspace import is_disk_error, is_full

        cfg, blobs, watch = self.cfg, self.blobs, self.watch
        next_gc = time.monotonic() + cfg.blob_gc_every_s
        while not self.stop.wait(limits.disk_poll_s):
            watch.check()
            if time.monotonic() >= next_gc:
                next_gc = time.monotonic() + cfg.blob_gc_every_s
                try:
                    removed = blobs.collect(cfg.blob_gc_grace_s, time.time())
                except Exception as e:
                    if not is_disk_error(e) or not is_full(e, cfg.data) or blobs.poisoned:
                        self._fatal(e)
                        raise
                    watch.write_failed(e)  # collecting needs a little room too: later
                    removed = 0
                if removed:
                    log.info("blobs_collected", blobs=removed)

    def _shut_down(self) -> None:
        """The clean stop, in order: HTTP (no new requests), the jobs thread, the driver
        (running items cut, the log of them removed), the blob writers, the other threads, then the journal synced and
        closed and the blob store closed."""
        log.info("meshd_stopping")
        sdnotify.notify("STOPPING=1")
        join_s = limits.thread_join_s_max
        if self.watchdog is not None:
            self.watchdog.stop()
        self.http.stop()
        self.t_http.join(join_s)
        self.jobs.stop()
        self.t_jobs.join(join_s)
        self.driver.stop()
        self.t_driver.join(join_s)
        if not self.t_driver.is_alive():
            self.running.close()  # every process reaped: the log of them goes
        self.writers.close()
        if self.mover is not None:
            self.mover.stop()
        self.item_logs.stop()
        self.history.stop()
        self.notifier.stop()
        if self.dump_sender is not None:
            self.dump_sender.stop()
        if self.links is not None:
            self.links.stop()
        for t in self.extra:
            t.join(join_s)
        self.replica.journal_sync()
        self.replica.close()
        self.blobs.close()
        log.info("meshd_stopped")


class _StartFailed(Exception):
    """A step of `Member.serve` could not start the member; it has said why on stderr, and
    `code` is meshd's exit status."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class _HttpBlobs:
    """The blob store as HTTP (and the blob mover) sees it. A write the disk fails (an fsync
    error) stops the member (fail-stop), as everywhere else; a write while the disk is full, or
    one the disk refuses for want of space, is StoreFull (the member turns read-only); and on a
    member of a bigger fleet, a blob this member does not hold is fetched from one that does
    before it is served."""

    def __init__(self, blobs, mover, fatal, watch=None) -> None:
        self._blobs = blobs
        self._mover = mover
        self._fatal = fatal
        self._watch = watch

    def __getattr__(self, name):
        return getattr(self._blobs, name)

    def _durably(self, fn, *args, grows: bool = True):
        from blobstore import StoreFull
        from meshjobs.diskspace import is_disk_error, is_full

        watch = self._watch
        if grows and watch is not None and watch.full:
            raise StoreFull(watch.refusal())
        try:
            return fn(*args)
        except Exception as exc:
            if not is_disk_error(exc) or isinstance(exc, StoreFull | FileNotFoundError):
                raise  # (a spool file that is gone is the caller's to handle, not the disk's)
            # A write refused for want of space left the store as it was (the transaction was
            # aborted): refuse it and turn read-only. Any other disk error stops the member.
            if watch is not None and is_full(exc, watch.folder) and not self._blobs.poisoned:
                watch.write_failed(exc)
                raise StoreFull(watch.refusal()) from exc
            self._fatal(exc)
            raise

    def put(self, data: bytes) -> str:
        return self._durably(self._blobs.put, data)

    def write_batch(self, payloads, owners=None):
        return self._durably(self._blobs.write_batch, payloads, owners)

    def put_file(self, path: str) -> str:
        return self._durably(self._blobs.put_file, path)

    def sync(self) -> bool:
        return self._durably(self._blobs.sync, grows=False)

    def open(self, digest: str):
        it = self._blobs.open(digest)
        if it is None and self._mover is not None and self._mover.fetch(digest, limits.blob_fetch_s_max):
            it = self._blobs.open(digest)
        return it

    def repair(self, digest: str) -> bool:
        """Replace a damaged copy of `digest` by a good one from another member: the damaged
        copy is dropped (its pins stay), then fetched again. False on a fleet of one, or when
        no member holds a good copy."""
        if self._blobs.check(digest) is not False:
            return self._blobs.has(digest)
        if self._mover is None:
            return False
        self._durably(self._blobs.drop_damaged, digest)
        return self._mover.fetch(digest, limits.blob_fetch_s_max)

    def size(self, digest: str):
        size = self._blobs.size(digest)
        if size is None and self._mover is not None and self._mover.fetch(digest, limits.blob_fetch_s_max):
            size = self._blobs.size(digest)
        return size


def _own_user() -> str:
    import pwd
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return str(os.geteuid())


def _write_file(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", opener=datadir.private_opener) as f:
        f.write(text)
    os.replace(tmp, path)


if __name__ == "__main__":
    main()

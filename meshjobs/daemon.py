"""meshd: one member of a meshjobs fleet. The only module that starts threads.

With no arguments it runs a fleet of one: data folder `./meshjobs-data`, HTTP on 127.0.0.1:7700,
Raft on 127.0.0.1:7702, a `default` pool of kind `command` with one slot per core. `--config FILE`
takes the TOML keys of DESIGN.md. SIGTERM or SIGINT stops it cleanly (exit 0): running items are
cut, and their leases are revoked and re-leased when the member starts again.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import threading
import time
import uuid

import structlog

from meshjobs import logs
from meshjobs.config import Config, ConfigError, load_config
from meshjobs.dumpfile import DumpCorrupt
from meshjobs.failpoints import Failpoints
from meshjobs.journal import JournalCorrupt
from meshjobs.node import JobNode, NodeConfig
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
    p.add_argument("--slots", type=int, metavar="N",
                   help="slots of the default pool (when the config names no pools)")
    p.add_argument("--log-level", default=None, help="debug, info, warning or error")
    p.add_argument("--demo", action="store_true",
                   help="start a throw-away fleet of one, run a few jobs through it, show them, stop")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    if args.demo:
        from meshjobs.demo import run_demo
        sys.exit(run_demo())
    logs.configure(args.log_level)
    try:
        cfg = load_config(args.config, {"name": args.name, "data": args.data, "http": args.http,
                                        "raft": args.raft})
        if args.slots is not None:
            if args.slots < 0 or "default" not in cfg.pools:
                raise ConfigError("--slots needs a default pool and a count of 0 or more")
            cfg.pools["default"].slots = args.slots
    except ConfigError as e:
        print(f"meshd: {e}", file=sys.stderr)
        sys.exit(2)
    sys.exit(Member(cfg).serve())


class Member:
    """All the parts of one meshd, wired together."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    def serve(self) -> int:
        # Imports that pull in the heavy parts stay here so `meshd --help` is quick.
        from blobstore.store import LmdbBlobStore
        from meshjobs.driver import Driver
        from meshjobs.http import HttpApi
        from meshjobs.jobsd import JobsThread
        from meshjobs.replica import Replica, open_secret

        cfg = self.cfg
        os.makedirs(cfg.data, exist_ok=True)
        failpoints = Failpoints.from_env()
        if cfg.voters or cfg.join:
            print("meshd: fleets of more than one member are not supported by this version yet; "
                  "remove [fleet] to run a fleet of one", file=sys.stderr)
            return 2
        secret = open_secret(cfg.secret_path, create=True)
        blobs = LmdbBlobStore(os.path.join(cfg.data, "blobs"), failpoints=failpoints)
        table = JobTable()
        boot = uuid.uuid4().hex[:12]
        node = JobNode(table, NodeConfig(member=cfg.name, boot=boot, pools=cfg.pools,
                                         keep_s=cfg.keep_s, keep_jobs=cfg.keep_jobs),
                       random.Random())
        try:
            replica = Replica(cfg.raft_addr, [], cfg.data, secret, table, failpoints,
                              names={cfg.raft_addr: cfg.name}, election_s=(0.05, 0.1))
        except (JournalCorrupt, DumpCorrupt) as e:
            log.critical("journal_damaged", error=str(e))
            print(f"meshd: {e}", file=sys.stderr)
            return 70
        except Exception as e:  # pysyncobj says BindError when the Raft port is taken
            if "BindError" in repr(e):
                print(f"meshd: cannot listen on Raft address {cfg.raft_addr}: is another meshd "
                      "running? (use --raft or the config's raft key)", file=sys.stderr)
                blobs.close()
                return 2
            raise
        jobs: JobsThread
        driver = Driver(blobs, os.path.join(cfg.data, "spool"),
                        on_end=lambda end: jobs.item_ended(end))
        jobs = JobsThread(node, replica, driver, blobs)
        http = HttpApi(cfg.http[0], cfg.http[1], jobs, blobs, cfg.name)

        stop = threading.Event()

        def on_signal(signum, _frame):
            log.info("signal", signal=signal.Signals(signum).name)
            stop.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

        def guarded(name, body):
            def target():
                try:
                    body()
                except BaseException:
                    log.exception("thread_crashed", thread=name)
                    os._exit(70)
                if not stop.is_set():
                    log.critical("thread_ended", thread=name)
                    os._exit(70)
            return threading.Thread(target=target, name=name, daemon=True)

        t_jobs = guarded("jobs", jobs.run)
        t_driver = guarded("driver", driver.run)
        http_ready = threading.Event()
        t_http = guarded("http", lambda: http.run(http_ready))
        t_driver.start()
        t_jobs.start()
        t_http.start()
        if not http_ready.wait(10):
            print(f"meshd: HTTP did not start on {cfg.http[0]}:{cfg.http[1]}", file=sys.stderr)
            os._exit(2)
        addr = f"{cfg.http[0]}:{http.bound_port}"
        _write_file(os.path.join(cfg.data, "http.addr"), addr + "\n")
        log.info("meshd_ready", member=cfg.name, http=f"http://{addr}", raft=cfg.raft_addr,
                 data=cfg.data, pools={p.name: p.slots for p in cfg.pools.values()}, boot=boot)

        # The main thread's own work while it waits for a signal: collecting blobs whose pins are
        # all gone (forgotten jobs), once the grace period has passed.
        next_gc = time.monotonic() + cfg.blob_gc_every_s
        while not stop.wait(1.0):
            if time.monotonic() >= next_gc:
                next_gc = time.monotonic() + cfg.blob_gc_every_s
                removed = blobs.collect(cfg.blob_gc_grace_s, time.time())
                if removed:
                    log.info("blobs_collected", blobs=removed)
        log.info("meshd_stopping")
        http.stop()
        t_http.join(10)
        jobs.stop()
        t_jobs.join(10)
        driver.stop()
        t_driver.join(10)
        replica.journal_sync()
        replica.close()
        blobs.close()
        log.info("meshd_stopped")
        return 0


def _write_file(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


if __name__ == "__main__":
    main()

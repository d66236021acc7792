"""A private redis-server for the peers: loopback, a non-default port, no persistence, its
files in a temporary folder; stopped by its pid."""

from __future__ import annotations

import os
import shutil

import redis

from bench.peers import Procs, wait_until


class RedisServer:
    def __init__(self, procs: Procs, folder: str) -> None:
        self.procs = procs
        self.folder = folder
        self.port = 6390 + os.getpid() % 100
        self.proc = None

    def url(self, db: int) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed: run bench/setup.sh (as root)")
        os.makedirs(self.folder, exist_ok=True)
        self.proc = self.procs.start(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.folder, "--daemonize", "no", "--databases", "4"],
            os.path.join(self.folder, "redis.log"))
        client = redis.Redis(port=self.port, socket_connect_timeout=1)

        def up() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited (port {self.port} taken?); see {self.folder}/redis.log")
            try:
                return bool(client.ping())
            except redis.ConnectionError:
                return False
        wait_until(up, 15, "redis-server answering", every_s=0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.procs.stop(self.proc)
            self.proc = None

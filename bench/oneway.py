"""Election churn under a one-way cut: 3 voters, one follower stops hearing the others for 8 s.

    sudo python bench/oneway.py [--rounds 3] [--cut-s 8] [--root /path/to/checkout]

Needs root and iptables. Each round: a fresh fleet of 3 voters; the voter with the lowest Raft
address is made a follower (if it leads, it is stopped with SIGSTOP until another leads); then
an iptables rule drops every packet to its Raft port (it can still send) for `--cut-s` seconds,
while a client submits `true` jobs one after another (each answered once committed) through the
leader and the other follower, alternately. Reported: how far the term rose during the cut (the
highest term any voter reports, and that of the two that still hear each other), the submits not answered 2xx, whether the leader changed, and
whether it changed within `--cut-s` after the cut healed (the returning follower deposing it).
`--root` runs the members from another checkout (the code before a change).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import machine  # noqa: E402
from tests.helpers import make_fleet, raft_address, raft_deaf  # noqa: E402


def health(m) -> dict:
    try:
        status, h = m.request("GET", "/healthz", timeout_s=1)
    except OSError:
        return {}
    return h if status == 200 and isinstance(h, dict) else {}


def leader(members, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for m in members:
            h = health(m)
            if h.get("is_leader") and h.get("ready"):
                return m
        time.sleep(0.05)
    raise RuntimeError("no leader")


def max_term(members) -> int:
    return max(health(m).get("term", 0) for m in members)


def submits(targets, until_s: float, stats: dict) -> None:
    i = 0
    while time.monotonic() < until_s:
        m = targets[i % len(targets)]
        i += 1
        try:
            status, _ = m.request("POST", "/jobs", {"argv": ["true"]}, timeout_s=10)
        except OSError:
            status = 0
        key = "ok" if status in (200, 201) else str(status)
        stats[key] = stats.get(key, 0) + 1


def one_round(top: str, cut_s: float, root: str | None) -> dict:
    members = make_fleet(top, voters=3, extra='[retention]\nkeep_jobs = 50\n')
    try:
        for m in members:
            m.extra_env = {"MESHJOBS_LOG_LEVEL": "warning"}
            if root:
                m.extra_env["PYTHONPATH"] = root
            m.start(wait_ready=False)
        for m in members:
            m.wait_ready()
        deaf = min(members, key=raft_address)
        lead = leader(members)
        while lead is deaf:
            os.kill(deaf.pid, signal.SIGSTOP)
            try:
                lead = leader([m for m in members if m is not deaf])
            finally:
                os.kill(deaf.pid, signal.SIGCONT)
            time.sleep(1.0)  # let it come back (and, before pre-vote, perhaps depose again)
            lead = leader(members)
        others = [m for m in members if m is not deaf]
        follower = next(m for m in others if m is not lead)
        submits(others, time.monotonic() + 1.0, {})  # warm up
        term0 = max_term(members)
        others0 = max_term(others)
        cut_stats: dict = {}
        with raft_deaf(deaf):
            submits([lead, follower], time.monotonic() + cut_s, cut_stats)
            term_cut = max_term(members)
            others_cut = max_term(others)
            lead_cut = leader(members)
        heal_stats: dict = {}
        submits([lead_cut, follower], time.monotonic() + cut_s, heal_stats)
        term_heal = max_term(members)
        lead_heal = leader(members)
        return {
            "term_rise_during_cut": term_cut - term0,
            "term_rise_others_during_cut": others_cut - others0,
            "term_rise_after_heal": term_heal - term_cut,
            "submits_during_cut": cut_stats,
            "submits_after_heal": heal_stats,
            "leader_changed_during_cut": lead_cut is not lead,
            "leader_changed_after_heal": lead_heal is not lead_cut,
        }
    finally:
        for m in members:
            m.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cut-s", type=float, default=8.0)
    ap.add_argument("--root", default=None, help="run the members from this checkout")
    a = ap.parse_args()
    print(f"machine: {machine()}")
    print(f"code: {a.root or 'this checkout'}")
    for r in range(a.rounds):
        with tempfile.TemporaryDirectory(prefix="meshbench-oneway-") as top:
            print(json.dumps({"round": r + 1, **one_round(top, a.cut_s, a.root)}), flush=True)


if __name__ == "__main__":
    main()

"""`meshd check-config FILE`: a config file checked as meshd would load it, without starting.

It reads the file with the code meshd starts with (meshjobs/config.py's `load_config`, which
checks the file's shape with meshjobs/configfile.py's models) and reports every problem at
once, each naming its key and what to do. Exit status 2 when there is any problem (the status
meshd exits with on a bad config), 0 with a one-line summary when the file is good.

What it cannot check from here is said where meshd checks it at start: whether the ports are
free, whether the fleet secret is there (and not readable by others), whether meshd may run a
pool's items as its `user`.
"""

from __future__ import annotations

import sys
from typing import TextIO

from meshjobs.config import Config, ConfigError, load_config

EXIT_OK = 0
EXIT_PROBLEMS = 2  # as meshd's own exit on a config it cannot run with


def summary(cfg: Config) -> str:
    """One line about a good config: the member, its role, the voters, its addresses."""
    if cfg.fleet_of_one:
        fleet = "a fleet of one"
    elif cfg.voters:
        fleet = "voters " + ", ".join(v.name for v in cfg.voters)
    else:
        assert cfg.join is not None
        fleet = f"joins the fleet through {cfg.join[0]}:{cfg.join[1]}"
    return (f"member {cfg.name}, {cfg.role}, {fleet}; HTTP {cfg.http[0]}:{cfg.http[1]}, "
            f"data {cfg.data}; {items_line(cfg)}")


def items_line(cfg: Config) -> str:
    """Who items that name no user run as, as meshd will run them (whatever user checks)."""
    from meshjobs import runas
    user = runas.item_user(cfg.item_user)
    if user is None:
        return (f"items that name no user: this machine has neither user {runas.ITEM_USER} nor "
                f"{runas.ITEM_USER_FALLBACK}, so meshd will not start where it may switch users; "
                "set [items] user")
    who = f"user {user}"
    return (f"items that name no user run as {who} when meshd may switch users (root, or "
            f"CAP_SETUID and CAP_SETGID), else as meshd's own uid")


def check_config(path: str, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Check the config file at `path`; print the summary (to `out`) or every problem (to
    `err`); return the exit status."""
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        cfg = load_config(path)
    except ConfigError as e:
        n = len(e.problems)
        print(f"meshd check-config: {path}: {n} problem{'s' if n != 1 else ''}; fix "
              f"{'each of them' if n != 1 else 'it'} and check again:", file=err)
        for problem in e.problems:
            print(f"  - {problem}", file=err)
        return EXIT_PROBLEMS
    print(f"ok: {path}: {summary(cfg)}", file=out)
    print(f"items: {walls_line(cfg)}", file=out)
    return EXIT_OK


def walls_line(cfg: Config) -> str:
    """What walls items would run behind if meshd started here now, as this user
    (meshjobs.wall), and the warning when none holds."""
    from meshjobs import runas, wall
    abi = wall.landlock_abi()
    st = wall.status(cfg.item_wall, abi, runas.can_switch_user(), "", cfg.data)
    said = ", ".join(st.walls) if st.walls else "none"
    if cfg.item_wall == "landlock" and abi == 0:
        return ("meshd would refuse to start: [items] wall = \"landlock\" and this kernel has "
                "no Landlock")
    return f"walls {said}" + (f"; WARNING: {st.warning}" if st.warning else "")

"""What `meshctl watch` submits: the config, the file lists and the jobs to make of them. Pure.

Theory of operation. A watch looks at the files of one folder (`path`). Each `glob` makes one file
list, sorted newest first (names Z->A, 9->0, as datestamped names sort; `reverse` turns it around)
after `min_age`/`max_age` have dropped files too young or too old. With `split` and `match`, the
lists are joined into filesets: the first `match` parts of a name (cut at `split`) are its key, and
a set is complete when every list has a file with the first list's key (`partial`: when the first
list has one). A set whose key plus `skip` exists is marked done and never run. Position n of the
list (file or set) runs `jobs[n]`, the last spec serving every position past the end, so as new
files arrive each older one moves down the chain; `run_all` runs the unprocessed specs 0..n in
turn, one index at a time. What has run is kept beside each file in `._<name>_<n>_<filename>.<state>`
(the job's result) and, for `updated`, the processed mtime: this module reads those facts from a
snapshot and says what to submit, write and remove; `meshjobs.watch` does the IO.

Rule 1: a job id is derived, never drawn: watch name, index, list, file name, mtime and attempt
  go through one digest. The same file at the same mtime is the same job, so a watcher killed
  between its submit and its state file submits the same id again, and meshd answers that the job
  exists: nothing runs twice.
Rule 2: state files are the only memory across restarts; in-flight ids are the edge's memory
  within one run. A damaged state file counts as its suffix says (`.done` is done); a failure of
  unknown attempt is retried from attempt 1, whose id meshd may already know (then it only waits).
Rule 3: config errors are all reported at once, each with its place and what to do; files that
  cannot be turned into a valid job are reported as problems of the plan, never raised.
Rule 4: every list, name and count is bounded by a named limit; the clock comes in as `now_ns`.
"""


from meshjobs.watchplan.config import (
    Config,
    Slot,
    Watch,
    WatchError,
    apply_overrides,
    build,
    fill,
    load_text,
    merge,
    rooted,
)
from meshjobs.watchplan.plan import (
    END_STATES,
    TMP_SUFFIX,
    FileFact,
    Plan,
    Snapshot,
    StateFact,
    Submit,
    ended,
    facts,
    job_id,
    listing,
    parse_state_name,
    plan,
    state_name,
)

__all__ = ["END_STATES", "TMP_SUFFIX", "Config", "FileFact", "Plan", "Slot", "Snapshot", "StateFact", "Submit",
           "Watch", "WatchError", "apply_overrides", "build", "ended", "facts", "fill", "job_id",
           "listing", "load_text", "merge", "parse_state_name", "plan", "rooted", "state_name"]

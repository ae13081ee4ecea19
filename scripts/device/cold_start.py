"""Time whole processes, one after another, as a user starts them: wall time and peak host memory.

    python3 scripts/device/cold_start.py OUT.json "TAG|ENV|COMMAND" ...

Each run: COMMAND (a shell command line) with the extra environment ENV ("K=V K2=V2", may be
empty), its wall time from fork to exit, its peak resident memory (the child's own rusage,
os.wait4), exit status, and the last lines of its stderr (generate's load / prompt / first
token report). Both pipes are read as the child writes them, so the run also says when its
first stdout bytes arrived (generate's first token: `first_stdout_s`) and its last stderr line
(`last_stderr_s`, generate's report; the rest up to `wall_s` is the process's exit). Runs go in the order given, so "first" and "second" runs of one command show
what a warm page cache and a written kernel cache change. Writes one receipt (kind
research/cold-start) with every run.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import threading
import time

from muse_mlx.tools.receipts import make_receipt, write_receipt


def _drain(pipe, t0: float, into: list) -> None:
    """Read `pipe` to its end, noting (seconds since t0, bytes) for each read."""
    while chunk := pipe.read1(65536):
        into.append((time.perf_counter() - t0, chunk))


def run(tag: str, env: str, command: str) -> dict:
    extra = dict(item.split("=", 1) for item in shlex.split(env))
    out, err = [], []
    t = time.perf_counter()
    proc = subprocess.Popen(command, shell=True, env={**os.environ, **extra}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    readers = [threading.Thread(target=_drain, args=(pipe, t, into)) for pipe, into in ((proc.stdout, out),
                                                                                         (proc.stderr, err))]
    for r in readers:
        r.start()
    _, status, usage = os.wait4(proc.pid, 0)   # reaped here, with the child's own rusage
    wall = time.perf_counter() - t
    for r in readers:
        r.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    stdout = b"".join(c for _, c in out).decode(errors="replace")
    lines = b"".join(c for _, c in err).decode(errors="replace").splitlines()
    result = {"tag": tag, "env": extra, "command": command, "wall_s": wall, "exit": proc.returncode,
              "first_stdout_s": out[0][0] if out else None, "last_stderr_s": err[-1][0] if err else None,
              "max_rss_bytes": usage.ru_maxrss * 1024, "stdout_head": stdout[:200], "stderr_tail": lines[-12:]}
    marks = "".join(f", {name} at {result[key]:.2f} s" for name, key in (("first output", "first_stdout_s"),
                                                                          ("last report", "last_stderr_s"))
                    if result[key] is not None)
    print(f"[{tag}] {wall:.2f} s{marks}, exit {result['exit']}, peak RSS {result['max_rss_bytes'] / 1e9:.2f} GB",
          flush=True)
    for line in lines[-8:]:
        print(f"[{tag}]   {line}", flush=True)
    return result


def main() -> int:
    out, specs = sys.argv[1], sys.argv[2:]
    runs = []
    for spec in specs:
        tag, env, command = spec.split("|", 2)
        runs.append(run(tag, env, command))
    write_receipt(out, make_receipt("research/cold-start", inputs={"runs": specs}, metrics={"runs": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

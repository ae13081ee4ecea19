"""Time whole processes, one after another, as a user starts them: wall time and peak host memory.

    python3 scripts/device/cold_start.py OUT.json "TAG|ENV|COMMAND" ...

Each run: COMMAND (a shell command line) with the extra environment ENV ("K=V K2=V2", may be
empty), its wall time from fork to exit, its peak resident memory (the child's own rusage,
os.wait4), exit status, and the last lines of its stderr (generate's load / prompt / first
token report). Runs go in the order given, so "first" and "second" runs of one command show
what a warm page cache and a written kernel cache change. Writes one receipt (kind
research/cold-start) with every run.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
import time

from muse_mlx.tools.receipts import make_receipt, write_receipt


def run(tag: str, env: str, command: str) -> dict:
    extra = dict(item.split("=", 1) for item in shlex.split(env))
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t = time.perf_counter()
        proc = subprocess.Popen(command, shell=True, env={**os.environ, **extra}, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)   # reaped here, with the child's own rusage
        wall = time.perf_counter() - t
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, lines = out.read().decode(errors="replace"), err.read().decode(errors="replace").splitlines()
    result = {"tag": tag, "env": extra, "command": command, "wall_s": wall, "exit": proc.returncode,
              "max_rss_bytes": usage.ru_maxrss * 1024, "stdout_head": stdout[:200], "stderr_tail": lines[-12:]}
    print(f"[{tag}] {wall:.2f} s, exit {result['exit']}, peak RSS {result['max_rss_bytes'] / 1e9:.2f} GB", flush=True)
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

"""One writer for every receipt: a JSON file that says how a number was obtained.

A receipt holds the command line, the git revision (and whether the tree was
dirty), the device and library versions, the inputs, the raw samples, the derived
metrics and a verdict. Benchmarks, parity runs and research commands all write
through `write_receipt`, so every number can be traced to the run that made it.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

RECEIPT_SCHEMA = 1
_PACKAGES = ("mlx", "mlx-cpu", "mlx-cuda-13", "mlx-metal", "numpy", "gguf", "tokenizers", "llama-cpp-python")


def git_revision(cwd: Path | None = None) -> dict:
    """HEAD and whether tracked files differ from it; when MUSE_GIT_REVISION is set (the lent
    GPU gets a copy of the working tree, whose .git, if any, is not the sender's), that revision."""
    cwd = cwd or Path(__file__).resolve().parents[1]
    sent = os.environ.get("MUSE_GIT_REVISION")
    if sent:
        return {"revision": sent, "source": "MUSE_GIT_REVISION (sent with the tree)"}

    def git(*args):
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)

    try:
        rev = git("rev-parse", "HEAD")
        if rev.returncode != 0:
            return {"revision": sent, "source": "MUSE_GIT_REVISION (sent with the tree)"} if sent else {"revision": None}
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!receipts").stdout.strip() != ""  # receipts being written do not count
        return {"revision": rev.stdout.strip(), "dirty": dirty}
    except (OSError, subprocess.TimeoutExpired):
        return {"revision": sent, "source": "MUSE_GIT_REVISION (sent with the tree)"} if sent else {"revision": None}


def versions() -> dict:
    out = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def device() -> dict:
    info = {"platform": platform.platform(), "machine": platform.machine(), "cpu_count": os.cpu_count()}
    try:
        import mlx.core as mx

        info["mlx_default_device"] = str(mx.default_device())
        info["metal"] = bool(mx.metal.is_available())
        info["cuda"] = bool(mx.cuda.is_available())
        if info["metal"] or info["cuda"]:
            info["device_info"] = {k: (v if isinstance(v, (int, float, str)) else str(v))
                                   for k, v in mx.device_info().items()}
    except Exception as exc:  # a receipt must still be written when MLX is unusable
        info["mlx_error"] = repr(exc)
    return info


def file_sha256(path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def make_receipt(kind: str, *, inputs: dict, metrics: dict, samples=None, verdict=None, notes=None,
                 synthetic: bool | None = None) -> dict:
    receipt = {
        "schema": RECEIPT_SCHEMA,
        "kind": kind,
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "git": git_revision(),
        "device": device(),
        "versions": versions(),
        "inputs": inputs,
        "metrics": metrics,
    }
    if synthetic is not None:
        receipt["synthetic"] = synthetic
    if samples is not None:
        receipt["samples"] = samples
    if verdict is not None:
        receipt["verdict"] = verdict
    if notes:
        receipt["notes"] = notes
    return receipt


def write_receipt(path, receipt: dict) -> Path:
    """Write atomically (tmp + rename): a receipt is either whole or absent."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(receipt, indent=2, sort_keys=False, default=_json_default) + "\n")
    os.replace(tmp, path)
    return path


def run_receipt_name(name: str, receipt: dict) -> str:
    """'<YYYY-MM-DD>-<revision>-<name>.json' for a receipt that one run writes beside earlier
    runs' (parity lanes): the UTC date of its created_utc and the first 7 hex digits of its git
    revision, '-dirty' after them when tracked files differed from that revision, 'norev' when
    none is known."""
    rev = receipt.get("git") or {}
    tag = "".join(c for c in str(rev.get("revision") or "")[:7] if c.isalnum()) or "norev"
    if rev.get("dirty"):
        tag += "-dirty"
    return f"{receipt['created_utc'][:10]}-{tag}-{name}.json"


def write_new_receipt(folder, name: str, receipt: dict) -> Path:
    """Write `receipt` to a new file in `folder` (run_receipt_name), never over an existing one:
    when the name is taken (another run of the same day and revision), '-2', '-3', ... is added
    before '.json'. Atomic like write_receipt: the file appears whole, under a name no other
    writer holds (a hard link from the temporary file, which fails if the name exists)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    stem = run_receipt_name(name, receipt)[: -len(".json")]
    tmp = folder / f".{stem}.json.tmp{os.getpid()}"
    tmp.write_text(json.dumps(receipt, indent=2, sort_keys=False, default=_json_default) + "\n")
    try:
        for n in range(1, 10_000):
            path = folder / (f"{stem}.json" if n == 1 else f"{stem}-{n}.json")
            try:
                os.link(tmp, path)
                return path
            except FileExistsError:
                continue
        raise FileExistsError(f"{folder}: no free name for {stem}.json")
    finally:
        tmp.unlink(missing_ok=True)


def _json_default(x):
    try:
        import numpy as np

        if isinstance(x, np.generic):
            return x.item()
        if isinstance(x, np.ndarray):
            return x.tolist()
    except ImportError:
        pass
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON-serialisable: {type(x).__name__}")

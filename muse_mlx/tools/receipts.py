"""One writer for every receipt: a JSON file that says how a number was obtained.

A receipt holds the command line, the git revision (and whether the tree was
dirty), the device and library versions, the inputs, the raw samples, the derived
metrics and a verdict. Benchmarks, parity runs and research commands all write
through `write_receipt`, so every number can be traced to the run that made it.

Output paths are checked before a command does its work (`check_output`,
`check_output_folder`: the folder exists, is a folder and is writable; the target is
not a folder); a file is written to a temporary file beside it and renamed into
place, the temporary file removed on any failure, and an OSError becomes one
MuseError naming the path and the system's reason.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import os
import platform
import stat
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import BinaryIO, Callable

from ..cli import read_regular_file
from ..errors import MuseError

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


def check_output(path, flag: str = "output", suffix: str | None = None) -> Path:
    """Refuse, before any long work, an output file that could not be written: an empty name, a
    name ending in a separator, one without `suffix` (e.g. ".png"), a folder that does not exist,
    is not a folder or is not writable, or a target that exists and is a folder or not a regular
    file. Folders are never created. Raises MuseError naming `flag` and the path."""
    text = str(path)
    if not text:
        raise MuseError(f"{flag}: an empty path")
    if text.endswith(("/", os.sep)):
        raise MuseError(f"{flag} {text}: names a folder, not a file")
    path = Path(text)
    folder = path.parent
    try:
        folder_mode = os.stat(folder).st_mode
    except FileNotFoundError:
        raise MuseError(f"{flag} {text}: folder {folder} does not exist") from None
    except NotADirectoryError:
        raise MuseError(f"{flag} {text}: {folder} is not a folder (a part of it is a file)") from None
    except OSError as exc:
        raise MuseError(f"{flag} {text}: folder {folder}: {_reason(exc)}") from None
    if not stat.S_ISDIR(folder_mode):
        raise MuseError(f"{flag} {text}: {folder} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise MuseError(f"{flag} {text}: folder {folder} is not writable")
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        raise MuseError(f"{flag} {text}: {_reason(exc)}") from None
    if mode is not None and stat.S_ISDIR(mode):
        raise MuseError(f"{flag} {text}: is a folder; name a file inside it")
    if mode is not None and not stat.S_ISREG(mode):
        raise MuseError(f"{flag} {text}: exists and is not a regular file")
    if suffix is not None and path.suffix.lower() != suffix:
        raise MuseError(f"{flag} {text}: the name must end in {suffix} (nothing is appended)")
    _probe(folder, f"{flag} {text}")
    return path


def check_output_folder(folder, flag: str = "output folder") -> Path:
    """Refuse a folder that files cannot be created in: missing, not a folder, not writable."""
    text = str(folder)
    if not text:
        raise MuseError(f"{flag}: an empty path")
    try:
        mode = os.stat(text).st_mode
    except FileNotFoundError:
        raise MuseError(f"{flag} {text}: does not exist") from None
    except NotADirectoryError:
        raise MuseError(f"{flag} {text}: is not a folder (a part of it is a file)") from None
    except OSError as exc:
        raise MuseError(f"{flag} {text}: {_reason(exc)}") from None
    if not stat.S_ISDIR(mode):
        raise MuseError(f"{flag} {text}: is not a folder")
    if not os.access(text, os.W_OK | os.X_OK):
        raise MuseError(f"{flag} {text}: is not writable")
    _probe(Path(text), f"{flag} {text}")
    return Path(text)


def _probe(folder: Path, where: str) -> None:
    """Create and remove a temporary file in `folder`: what os.access cannot tell (a read-only
    file system for root, /proc, a full quota) found before the work rather than after it."""
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".muse-probe.", suffix=".tmp")
    except OSError as exc:
        raise MuseError(f"{where}: cannot create a file in {folder}: {_reason(exc)}") from None
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(tmp)


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def _temp_beside(path: Path, where: str) -> tuple[int, Path]:
    """A new temporary file in `path`'s folder (mode as a plain open would give it)."""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise MuseError(f"{where}: cannot write: {_reason(exc)}") from None
    umask = os.umask(0o022)
    os.umask(umask)
    with contextlib.suppress(OSError):
        os.fchmod(fd, 0o666 & ~umask)
    return fd, Path(tmp)


def write_atomic(path, write: Callable[[BinaryIO], None], flag: str = "output") -> Path:
    """`write(f)` into a temporary file beside `path`, then renamed over it: the file is either
    whole or absent, and the temporary file is removed on any failure. An OSError becomes a
    MuseError naming the path and the system's reason."""
    path = check_output(path, flag)
    where = f"{flag} {path}"
    fd, tmp = _temp_beside(path, where)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise MuseError(f"{where}: cannot write: {_reason(exc)}") from None
        raise
    return path


def _receipt_bytes(receipt: dict) -> bytes:
    return (json.dumps(receipt, indent=2, sort_keys=False, default=_json_default) + "\n").encode()


def write_receipt(path, receipt: dict, flag: str = "--receipt") -> Path:
    """Write atomically (temporary file beside it + rename): a receipt is either whole or absent.
    The folder must exist (check_output); a failure is a MuseError and leaves no temporary file."""
    data = _receipt_bytes(receipt)
    return write_atomic(path, lambda f: f.write(data), flag)


def read_json(path, flag: str = "input", limit: int = 64 << 20):
    """A JSON file given on the command line, or one MuseError naming the flag, the file and
    what was wrong (unreadable, a folder, over `limit` bytes, not UTF-8, not JSON)."""
    where = f"{flag} {path}"
    try:
        data = read_regular_file(path, limit)
    except OSError as exc:
        raise MuseError(f"{where}: cannot read: {_reason(exc)}") from None
    if len(data) > limit:
        raise MuseError(f"{where}: larger than {limit:,} bytes; not a receipt")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise MuseError(f"{where}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise MuseError(f"{where}: not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise MuseError(f"{where}: JSON nested too deeply") from None


def json_kind(value) -> str:
    """What a JSON value is, for messages: 'an object', 'an array', 'a string', ..."""
    if isinstance(value, bool):
        return "a boolean"
    if value is None:
        return "null"
    for t, name in ((dict, "an object"), (list, "an array"), (str, "a string"), ((int, float), "a number")):
        if isinstance(value, t):
            return name
    return type(value).__name__


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


def write_new_receipt(folder, name: str, receipt: dict, flag: str = "--receipt-dir") -> Path:
    """Write `receipt` to a new file in `folder` (run_receipt_name), never over an existing one:
    when the name is taken (another run of the same day and revision), '-2', '-3', ... is added
    before '.json'. Atomic like write_receipt: the file appears whole, under a name no other
    writer holds (a hard link from the temporary file, which fails if the name exists). The
    folder must exist; a failure is a MuseError and leaves no temporary file."""
    folder = check_output_folder(folder, flag)
    stem = run_receipt_name(name, receipt)[: -len(".json")]
    data = _receipt_bytes(receipt)
    where = f"{flag} {folder}"
    fd, tmp = _temp_beside(folder / f"{stem}.json", where)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        for n in range(1, 10_000):
            path = folder / (f"{stem}.json" if n == 1 else f"{stem}-{n}.json")
            try:
                os.link(tmp, path)
                return path
            except FileExistsError:
                continue
        raise MuseError(f"{where}: no free name for {stem}.json")
    except OSError as exc:
        raise MuseError(f"{where}: cannot write {stem}.json: {_reason(exc)}") from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


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

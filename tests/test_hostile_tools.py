"""Hostile input to the other CLIs (issue 19, "The other CLIs" and item 5, "CLI edges").

envelope, footprint, bench and parity: nonsense numbers, bad --bench-receipt files and bad
output paths for --receipt / --receipt-dir / --plot each give one line, `error: ...`, and exit
2, and leave nothing half-written (no receipt, no temporary file) behind. Everything here runs
on the CPU: the bench's flags are checked before any model is loaded.
"""

import errno
import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest

from muse_mlx.errors import MuseError
from muse_mlx.tools import bench, bench_serving, envelope, footprint, parity, receipts

PROC_MISSING = "/proc/muse-nope/receipt.json"  # a folder that does not exist, not creatable even by root
PROC_UNWRITABLE = "/proc/muse-receipt.json"  # an existing folder no file can be created in, even by root


def refused(main, argv, capsys) -> str:
    """Run a CLI's main in-process: exit 2 and exactly one stderr line, `error: ...`; that line."""
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def run_module(module, *args):
    return subprocess.run([sys.executable, "-m", f"muse_mlx.tools.{module}", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.fixture
def read_only_dir(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    try:
        if os.access(d, os.W_OK):
            pytest.skip("this user ignores permissions (root): chmod 0o500 leaves the folder writable")
        yield d
    finally:
        d.chmod(0o700)


def bad_output_paths(tmp_path, name: str) -> dict:
    """Output paths no file can be written at, by what is wrong with them."""
    (tmp_path / "afile").write_text("a regular file\n")
    (tmp_path / "adir").mkdir()
    return {
        "an existing folder": (tmp_path / "adir", "is a folder"),
        "a missing folder": (tmp_path / "missing" / name, "does not exist"),
        "a file as a folder": (tmp_path / "afile" / name, "is not a folder"),
        "a folder under a file": (tmp_path / "afile" / "sub" / name, "is not a folder"),
        "a missing system folder": (Path(PROC_MISSING).with_name(name), "does not exist"),
        "an unwritable system folder": (Path(PROC_UNWRITABLE).with_name(f"muse-{name}"), ""),
        "a trailing separator": (f"{tmp_path / name}/", "names a folder"),
    }


OUTPUT_CASES = ["an existing folder", "a missing folder", "a file as a folder", "a folder under a file",
                "a missing system folder", "an unwritable system folder", "a trailing separator"]


# ---- envelope: numbers --------------------------------------------------------------------


@pytest.mark.parametrize("argv, says", [
    (["--file-bytes", "0"], "--file-bytes must be between 1"),          # was ZeroDivisionError
    (["--file-bytes", "-1"], "--file-bytes must be between 1"),         # was accepted
    (["--file-bytes", str(2**64)], "--file-bytes must be between 1"),
    (["--file-bytes", str(10**100)], "got a 101-digit number"),
    (["--file-bytes", "1e9"], "--file-bytes: invalid int value"),
    (["--tok-s", "inf"], "--tok-s: must be a finite number > 0"),       # was accepted
    (["--tok-s", "nan"], "--tok-s: must be a finite number > 0"),
    (["--tok-s", "-3"], "--tok-s: must be a finite number > 0"),
    (["--tok-s", "0"], "--tok-s: must be a finite number > 0"),
    (["--tok-s", "fast"], "--tok-s: expected a number"),
    (["--tok-s", "1e300"], "out of range"),                             # effective GB/s overflows to inf
    (["--tok-s", "5e-324"], "out of range"),                            # token time overflows to inf
    (["--tok-s", "30", "--ceiling-gbps", "0"], "--ceiling-gbps: must be a finite number > 0"),
    (["--tok-s", "30", "--ceiling-gbps", "-100"], "--ceiling-gbps: must be a finite number > 0"),
    (["--tok-s", "30", "--ceiling-gbps", "inf"], "--ceiling-gbps: must be a finite number > 0"),
    (["--tok-s", "30", "--ceiling-gbps", "nan"], "--ceiling-gbps: must be a finite number > 0"),
    (["--ceiling-gbps", "1000"], "--ceiling-gbps needs a throughput"),
    (["--depth", "-1"], "--depth must be >= 0"),
    (["--depth", "999999999999"], "exceeds the model's"),
])
def test_envelope_nonsense_numbers(argv, says, capsys):
    assert says in refused(envelope.main, argv, capsys)


def test_envelope_file_bytes_zero_subprocess():
    r = run_module("envelope", "--file-bytes", "0")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == ["error: --file-bytes must be between 1 and 9,223,372,036,854,775,807, got 0"]


def test_envelope_tok_s_inf_subprocess():
    r = run_module("envelope", "--tok-s", "inf")
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and "finite" in r.stderr, r.stderr


# ---- envelope: --bench-receipt --------------------------------------------------------------


BENCH_RECEIPTS = {
    "binary data": (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe\x00\x80", "not UTF-8 text"),
    "invalid UTF-8": (b'{"metrics": {"decode_tok_s": 35.0}, "note": "caf\xe9"}', "not UTF-8 text (byte 0xe9"),
    "empty": (b"", "not JSON"),
    "not JSON": (b"decode_tok_s = 35\n", "not JSON"),
    "NUL bytes": (b"\x00" * 64, "not JSON"),
    "deeply nested": (b"[" * 200_000 + b"]" * 200_000, "nested too deeply"),
    "a list": (b"[35.0]", "expected a JSON object (a bench receipt), found an array"),
    "a string": (b'"35 tok/s"', "found a string"),
    "no metrics": (b'{"decode_tok_s": 35.0}', "no metrics.decode_tok_s"),
    "metrics a list": (b'{"metrics": [35.0]}', "metrics is an array"),
    "no decode_tok_s": (b'{"metrics": {"prefill_tok_s": 900.0}}', "no metrics.decode_tok_s"),
    "a string there": (b'{"metrics": {"decode_tok_s": "fast"}}', "metrics.decode_tok_s is a string, not a number"),
    "null there": (b'{"metrics": {"decode_tok_s": null}}', "metrics.decode_tok_s is null"),
    "a boolean there": (b'{"metrics": {"decode_tok_s": true}}', "is a boolean"),
    "a list there": (b'{"metrics": {"decode_tok_s": [35.0]}}', "is an array"),
    "a mean-less object": (b'{"metrics": {"decode_tok_s": {"cv": 0.1}}}', "without a mean"),
    "a string mean": (b'{"metrics": {"decode_tok_s": {"mean": "35"}}}', "metrics.decode_tok_s.mean is a string"),
    "NaN": (b'{"metrics": {"decode_tok_s": NaN}}', "not a finite number > 0"),
    "Infinity": (b'{"metrics": {"decode_tok_s": {"mean": Infinity}}}', "not a finite number > 0"),
    "negative": (b'{"metrics": {"decode_tok_s": -35.0}}', "not a finite number > 0"),
    "zero": (b'{"metrics": {"decode_tok_s": 0}}', "not a finite number > 0"),
    "a huge integer": (b'{"metrics": {"decode_tok_s": 1' + b"0" * 400 + b"}}", "not a finite number > 0"),
}


@pytest.mark.parametrize("case", list(BENCH_RECEIPTS))
def test_envelope_bench_receipt_wrong_content(case, tmp_path, capsys):
    data, says = BENCH_RECEIPTS[case]
    path = tmp_path / "bench.json"
    path.write_bytes(data)
    line = refused(envelope.main, ["--bench-receipt", path], capsys)
    assert f"--bench-receipt {path}: " in line and says in line, line


@pytest.mark.parametrize("case, says", [("missing", "No such file"), ("a directory", "Is a directory"),
                                        ("a file as a folder", "Not a directory")])
def test_envelope_bench_receipt_unreadable(case, says, tmp_path, capsys):
    (tmp_path / "afile").write_text("{}")
    path = {"missing": tmp_path / "none.json", "a directory": tmp_path,
            "a file as a folder": tmp_path / "afile" / "bench.json"}[case]
    line = refused(envelope.main, ["--bench-receipt", path], capsys)
    assert f"--bench-receipt {path}: cannot read: {says}" in line, line


def test_envelope_bench_receipt_too_large(tmp_path, capsys):
    path = tmp_path / "big.json"
    path.write_bytes(b" " * 100)
    with pytest.raises(MuseError, match="larger than 10 bytes"):
        receipts.read_json(path, "--bench-receipt", limit=10)


def test_envelope_bench_receipt_binary_subprocess(tmp_path):
    path = tmp_path / "bench.json"
    path.write_bytes(bytes(range(256)) * 4)
    r = run_module("envelope", "--bench-receipt", path)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith(f"error: --bench-receipt {path}: not UTF-8 text"), r.stderr


@pytest.mark.parametrize("value", [b"35.5", b'{"mean": 35.5, "cv": 0.01}'])
def test_envelope_bench_receipt_good_shapes_still_work(value, tmp_path, capsys):
    path = tmp_path / "bench.json"
    path.write_bytes(b'\xef\xbb\xbf{"metrics": {"decode_tok_s": ' + value + b"}}")  # a BOM is allowed
    assert envelope.main(["--bench-receipt", str(path), "--ceiling-gbps", "4800"]) == 0
    assert "derived at 35.5 tok/s" in capsys.readouterr().out


# ---- --receipt in every CLI that has one ----------------------------------------------------


CLI_RECEIPT_ARGS = {
    "envelope": (envelope.main, ["--tok-s", "35.4395"]),
    "footprint": (footprint.main, ["--contexts", "2048"]),
    "bench": (bench.main, ["--model", "never-loaded.gguf"]),
}


@pytest.fixture
def no_bench_run(monkeypatch):
    def fail(args):
        raise AssertionError("the bench reached run_bench: a flag was not checked first")

    monkeypatch.setattr(bench, "run_bench", fail)


@pytest.mark.parametrize("cli", list(CLI_RECEIPT_ARGS))
@pytest.mark.parametrize("case", OUTPUT_CASES)
def test_receipt_bad_output_path(cli, case, tmp_path, capsys, no_bench_run):
    main, argv = CLI_RECEIPT_ARGS[cli]
    path, says = bad_output_paths(tmp_path, "receipt.json")[case]
    before = listing(tmp_path)
    line = refused(main, [*argv, "--receipt", path], capsys)
    assert "--receipt" in line and str(path).rstrip("/") in line and says in line, line
    assert listing(tmp_path) == before  # nothing written, no temporary file
    assert listing(tmp_path / "adir") == []


@pytest.mark.parametrize("cli", list(CLI_RECEIPT_ARGS))
def test_receipt_read_only_folder(cli, read_only_dir, capsys, no_bench_run):
    main, argv = CLI_RECEIPT_ARGS[cli]
    line = refused(main, [*argv, "--receipt", read_only_dir / "receipt.json"], capsys)
    assert "is not writable" in line, line
    assert listing(read_only_dir) == []


@pytest.mark.parametrize("cli", list(CLI_RECEIPT_ARGS))
def test_receipt_empty_path(cli, capsys, no_bench_run):
    main, argv = CLI_RECEIPT_ARGS[cli]
    assert "--receipt: an empty path" in refused(main, [*argv, "--receipt="], capsys)


def test_receipt_at_a_directory_subprocess(tmp_path):
    r = run_module("envelope", "--tok-s", "35", "--receipt", tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [f"error: --receipt {tmp_path}: is a folder; name a file inside it"]
    assert listing(tmp_path) == []


def test_receipt_under_a_missing_system_path_subprocess():
    r = run_module("footprint", "--contexts", "2048", "--receipt", PROC_MISSING)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [f"error: --receipt {PROC_MISSING}: folder /proc/muse-nope does not exist"]


def test_receipt_still_written_whole(tmp_path, capsys):
    path = tmp_path / "env.json"
    path.write_text("an older receipt")
    assert envelope.main(["--tok-s", "35.4395", "--receipt", str(path)]) == 0
    assert json.loads(path.read_text())["kind"] == "envelope"
    assert listing(tmp_path) == ["env.json"]
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    m = os.umask(0o022)
    os.umask(m)
    return m


# ---- the writers: atomic, clean, one MuseError ------------------------------------------------


def test_write_receipt_failed_rename_leaves_no_temp(tmp_path, monkeypatch):
    def no_room(src, dst):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(receipts.os, "replace", no_room)
    path = tmp_path / "r.json"
    with pytest.raises(MuseError, match=rf"--receipt {path}: cannot write: No space left on device"):
        receipts.write_receipt(path, {"a": 1})
    assert listing(tmp_path) == []


def test_write_atomic_failed_writer_leaves_no_temp_and_keeps_the_old_file(tmp_path):
    path = tmp_path / "fig.png"
    path.write_bytes(b"old")

    def half(f):
        f.write(b"half a picture")
        raise RuntimeError("the writer broke")

    with pytest.raises(RuntimeError, match="the writer broke"):
        receipts.write_atomic(path, half, "--plot")
    assert listing(tmp_path) == ["fig.png"] and path.read_bytes() == b"old"


def test_write_receipt_at_a_directory(tmp_path):
    with pytest.raises(MuseError, match="is a folder"):
        receipts.write_receipt(tmp_path, {"a": 1})
    assert listing(tmp_path) == []


def test_write_receipt_creates_no_folders(tmp_path):
    with pytest.raises(MuseError, match="does not exist"):
        receipts.write_receipt(tmp_path / "a" / "b" / "r.json", {"a": 1})
    assert listing(tmp_path) == []


def test_write_receipt_unwritable_system_folder():
    with pytest.raises(MuseError, match=rf"--receipt {PROC_UNWRITABLE}: (cannot create a file in /proc|folder /proc is not writable)"):
        receipts.write_receipt(PROC_UNWRITABLE, {"a": 1})


def test_write_receipt_refuses_a_device(tmp_path):
    with pytest.raises(MuseError, match="not a regular file"):
        receipts.write_receipt(os.devnull, {"a": 1})


def _parity_receipt() -> dict:
    return {"created_utc": "2026-12-01T00:00:00+00:00", "git": {"revision": "0123456789abcdef", "dirty": False}}


def test_write_new_receipt_failed_link_leaves_no_temp(tmp_path, monkeypatch):
    def no_links(src, dst):
        raise OSError(errno.EPERM, os.strerror(errno.EPERM))

    monkeypatch.setattr(receipts.os, "link", no_links)
    with pytest.raises(MuseError, match=rf"--receipt-dir {tmp_path}: cannot write 2026-12-01-0123456-f32.json: "
                                        "Operation not permitted"):
        receipts.write_new_receipt(tmp_path, "f32", _parity_receipt())
    assert listing(tmp_path) == []


@pytest.mark.parametrize("folder, says", [("/proc/muse-nope", "does not exist"), ("FILE", "is not a folder"),
                                          ("MISSING", "does not exist")])
def test_write_new_receipt_bad_folder(folder, says, tmp_path):
    (tmp_path / "afile").write_text("x")
    folder = {"FILE": tmp_path / "afile", "MISSING": tmp_path / "missing"}.get(folder, folder)
    with pytest.raises(MuseError, match=says):
        receipts.write_new_receipt(folder, "f32", _parity_receipt())
    assert listing(tmp_path) == ["afile"]


def test_write_new_receipt_still_numbers_runs(tmp_path):
    names = [receipts.write_new_receipt(tmp_path, "f32", _parity_receipt()).name for _ in range(3)]
    assert names == ["2026-12-01-0123456-f32.json", "2026-12-01-0123456-f32-2.json", "2026-12-01-0123456-f32-3.json"]
    assert listing(tmp_path) == sorted(names)


# ---- parity: --receipt-dir and flags, checked before the model is opened ----------------------


@pytest.mark.parametrize("case", ["a missing folder", "a file", "a file as a folder", "a missing system folder",
                                  "an empty path"])
def test_parity_receipt_dir_bad(case, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    folder, says = {"a missing folder": (tmp_path / "missing", "does not exist"),
                    "a file": (tmp_path / "afile", "is not a folder"),
                    "a file as a folder": (tmp_path / "afile" / "sub", "is not a folder"),
                    "a missing system folder": ("/proc/muse-nope", "does not exist"),
                    "an empty path": ("", "an empty path")}[case]
    # --model names no file: the receipt folder is refused before the model is opened
    line = refused(parity.main, ["--model", tmp_path / "none.gguf", f"--receipt-dir={folder}"], capsys)
    assert "--receipt-dir" in line and says in line, line
    assert listing(tmp_path) == ["afile"]


def test_parity_receipt_dir_read_only(read_only_dir, capsys, tmp_path):
    line = refused(parity.main, ["--model", tmp_path / "none.gguf", "--receipt-dir", read_only_dir], capsys)
    assert "is not writable" in line


@pytest.mark.parametrize("argv, says", [
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--prefill", "-5"], "--prefill must be >= 1"),
    (["--decode-steps", "-1"], "--decode-steps and --greedy >= 0"),
    (["--greedy", "-1"], "--decode-steps and --greedy >= 0"),
])
def test_parity_flags(argv, says, tmp_path, capsys):
    assert says in refused(parity.main, ["--model", tmp_path / "none.gguf", *argv], capsys)


def test_parity_workdir_a_file(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    line = refused(parity.main, ["--model", tmp_path / "none.gguf", "--receipt-dir", tmp_path,
                                 "--workdir", tmp_path / "afile"], capsys)
    assert "--workdir" in line and "is not a folder" in line


def test_parity_prompt_file_not_utf8(f32_fixture, tmp_path, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_bytes(b"hello \xff\xfe world")
    line = refused(parity.main, ["--model", f32_fixture, "--receipt-dir", tmp_path, "--prompt-file", prompt,
                                 "--prefill", "2", "--decode-steps", "1", "--greedy", "0"], capsys)
    assert f"--prompt-file {prompt}: not UTF-8 text" in line


# ---- footprint: --plot and numbers ------------------------------------------------------------


@pytest.mark.parametrize("case", OUTPUT_CASES)
def test_footprint_plot_bad_output_path(case, tmp_path, capsys):
    path, says = bad_output_paths(tmp_path, "fig.png")[case]
    before = listing(tmp_path)
    line = refused(footprint.main, ["--contexts", "2048", "--plot", path], capsys)
    assert "--plot" in line and says in line, line
    assert listing(tmp_path) == before and listing(tmp_path / "adir") == []


def test_footprint_plot_directory_writes_nothing_beside_it(tmp_path, capsys):
    d = tmp_path / "figs"
    d.mkdir()
    line = refused(footprint.main, ["--plot", d], capsys)  # used to write figs.png and exit 0
    assert line == f"error: --plot {d}: is a folder; name a file inside it"
    assert listing(tmp_path) == ["figs"] and listing(d) == []


@pytest.mark.parametrize("name", ["figure", "figure.jpg", "figure.png.txt", "figure.svg"])
def test_footprint_plot_needs_png(name, tmp_path, capsys):
    line = refused(footprint.main, ["--plot", tmp_path / name], capsys)
    assert line == f"error: --plot {tmp_path / name}: the name must end in .png (nothing is appended)"
    assert listing(tmp_path) == []


def test_footprint_plot_read_only(read_only_dir, capsys):
    assert "is not writable" in refused(footprint.main, ["--plot", read_only_dir / "fig.png"], capsys)
    assert listing(read_only_dir) == []


def test_footprint_plot_directory_subprocess(tmp_path):
    r = run_module("footprint", "--plot", tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [f"error: --plot {tmp_path}: is a folder; name a file inside it"]
    assert listing(tmp_path) == [] and not tmp_path.with_suffix(".png").exists()


def test_footprint_plot_written_whole(tmp_path, capsys):
    path = tmp_path / "fig.PNG"
    assert footprint.main(["--contexts", "2048", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert listing(tmp_path) == ["fig.PNG"]


@pytest.mark.parametrize("argv, says", [
    (["--contexts", "0"], "--contexts must be positive integers, got 0"),
    (["--contexts", "2048,-1"], "--contexts must be positive integers, got -1"),
    (["--contexts", "10" + "0" * 30], "exceeds the model's limit"),
    (["--contexts", "9" * 5000], "must be a comma-separated list of integers"),  # past int()'s digit limit
    (["--contexts", "2048,abc"], "got 'abc'"),
    (["--contexts", "1e5"], "got '1e5'"),
    (["--contexts", ","], "at least one context"),
    (["--contexts="], "at least one context"),
    (["--slots", "0"], "--slots must be between 1"),
    (["--slots", "-4"], "--slots must be between 1"),
    (["--slots", str(10**400)], "--slots must be between 1 and 1,048,576, got a 401-digit number"),
])
def test_footprint_nonsense_numbers(argv, says, capsys):
    line = refused(footprint.main, argv, capsys)
    assert says in line and len(line) < 300, line


# ---- bench: flags, checked on the CPU before any model is loaded -----------------------------


@pytest.mark.parametrize("argv, says", [
    (["--reps", "0"], "--reps must be >= 1, got 0"),
    (["--reps", "-3"], "--reps must be >= 1, got -3"),
    (["--warmup", "-1"], "--warmup must be >= 0, got -1"),
    (["--decode-tokens", "0"], "--decode-tokens must be >= 1, got 0"),
    (["--decode-tokens", "-64"], "--decode-tokens must be >= 1, got -64"),
    (["--depths", "-1"], "--depths must be >= 0, got -1"),
    (["--depths", "0,-32768"], "--depths must be >= 0, got -32768"),
    (["--depths", "0,deep"], "--depths: expected comma-separated integers"),
    (["--prefill", "-512"], "--prefill lengths must be >= 1, got -512"),
    (["--prefill", "512,0"], "--prefill lengths must be >= 1, got 0"),
    (["--prefill", "1.5"], "--prefill: expected comma-separated integers"),
    (["--prefill-depths", "0,-512"], "--prefill-depths must be >= 0, got -512"),
    (["--prefill-depths", "deep"], "--prefill-depths: expected comma-separated integers"),
    (["--kernel-config", "prefill_f16=2"], "kernel config prefill_f16 must be an integer 0..1, got 2"),
    (["--reps", "inf"], "--reps: invalid int value"),
    (["--kernel-config", "nonsense"], "--kernel-config"),
])
def test_bench_flags(argv, says, capsys, no_bench_run):
    line = refused(bench.main, ["--model", "never-loaded.gguf", *argv], capsys)
    assert says in line, line


def test_bench_reps_zero_subprocess():
    r = run_module("bench", "--model", "never-loaded.gguf", "--reps", "0")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == ["error: --reps must be >= 1, got 0"]


def _bench_json(tmp_path, ours, llama):
    a, b = tmp_path / "ours.json", tmp_path / "llama.json"
    a.write_bytes(ours if isinstance(ours, bytes) else json.dumps(ours).encode())
    b.write_bytes(llama if isinstance(llama, bytes) else json.dumps(llama).encode())
    return a, b


GOOD_OURS = {"metrics": {"decode": [{"depth": 0, "tok_s": {"mean": 50.0}}], "prefill": []}}


@pytest.mark.parametrize("ours, llama, says", [
    (b"\xff\xd8\xff\xe0 binary", [], "not UTF-8 text"),
    ([1, 2], [], "expected a bench receipt (a JSON object), found an array"),
    ({"metrics": 3}, [], "not a bench receipt (metrics is a number, not an object)"),
    ({"kind": "bench"}, [], "not a bench receipt (metrics is null, not an object)"),
    (GOOD_OURS, {"n_gen": 64}, "expected llama-bench's -o json output (an array), found an object"),
    (GOOD_OURS, [{"n_gen": 64, "n_depth": 0}], "record 0 of llama-bench's output does not fit"),
    (GOOD_OURS, ["a string"], "record 0"),
    (GOOD_OURS, [{"n_gen": 64, "n_depth": 0, "avg_ts": "fast", "stddev_ts": 1}], "record 0"),
])
def test_bench_combine_wrong_files(ours, llama, says, tmp_path, capsys):
    a, b = _bench_json(tmp_path, ours, llama)
    assert says in refused(bench.main, ["--combine", a, b], capsys)


def test_bench_combine_missing_file(tmp_path, capsys):
    line = refused(bench.main, ["--combine", tmp_path / "none.json", tmp_path], capsys)
    assert f"--combine {tmp_path / 'none.json'}: cannot read: No such file" in line


def test_bench_combine_still_works(tmp_path, capsys):
    a, b = _bench_json(tmp_path, GOOD_OURS, [{"n_prompt": 0, "n_gen": 64, "n_depth": 0, "avg_ts": 100.0,
                                               "stddev_ts": 1.0}])
    out = tmp_path / "compare.json"
    assert bench.main(["--combine", str(a), str(b), "--receipt", str(out)]) == 0
    assert "ratio llama/ours 2.000" in capsys.readouterr().out
    assert json.loads(out.read_text())["metrics"]["ratios"][0]["ratio_llama_over_ours"] == 2.0


# ---- bench_serving: the matvec cells' flags, refused before any model is loaded -----------------


@pytest.mark.parametrize("argv, says", [
    (["--matvec-rows", "9"], "--matvec-rows values must be 1..8"),
    (["--matvec-rows", "2,x"], "--matvec-rows: expected comma-separated integers"),
    (["--matvec-rows", "2", "--matvec-configs", "stream_batch_rf=2"], "needs a tag"),
    (["--matvec-rows", "2", "--matvec-configs", "a:stream_batch_rf=3"], "stream_batch_rf must be 0, 1, 2 or 4"),
    (["--matvec-rows", "2", "--reference"], "the MLX-ops backend (--reference) has none"),
    (["--scheduler", "5"], "--scheduler values must be 1..4"),
    (["--scheduler", "2", "--sched-tokens", "0"], "--sched-tokens and --sched-reps >= 1"),
    (["--scheduler", "2", "--sched-reps", "0"], "--sched-tokens and --sched-reps >= 1"),
    (["--cold-reps", "0"], "--cold-reps must be >= 1"),
])
def test_bench_serving_matvec_flags(argv, says, capsys):
    line = refused(bench_serving.main, ["--model", "/nonexistent/model.gguf", *argv], capsys)
    assert says in line, line


def test_bench_serving_warm_cell_on_the_cpu(f32_fixture, tmp_path):
    """The warm cell end to end on the reference backend (a smoke run: the numbers mean nothing on
    the CPU), past one prefill chunk so that a checkpoint is restored, with one cold prefill."""
    out = tmp_path / "warm.json"
    assert bench_serving.main(["--model", str(f32_fixture), "--reference", "--warm", "530", "--cold-max", "530",
                               "--cold-reps", "1", "--batch", "", "--workdir", str(tmp_path / "w"),
                               "--receipt", str(out)]) == 0
    cell = json.loads(out.read_text())["metrics"]["warm"][0]
    assert cell["checkpoint"] == 512 and cell["prefilled_after_restore"] == 18
    assert len(cell["cold_ttft_s"]["samples"]) == 1 and cell["repeat_ttft_s"]["mean"] > 0


@pytest.mark.parametrize("constraint", ["none", "text", "lazy", "dry"])
def test_bench_serving_engine_loop_cell_on_the_cpu(f32_fixture, tmp_path, constraint, monkeypatch):
    """The engine-loop cell end to end on the reference backend (a smoke run: the numbers mean
    nothing on the CPU): every request gets its first token and its tokens, the receipt holds them;
    with --sched-constraint each request holds its own grammar (the text one's tokens are its words),
    or with `dry` its own DRY state (each sampler made paced)."""
    from muse_mlx import slots

    samplers = []

    class Recorded(slots.Sampler):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            samplers.append(self)
    monkeypatch.setattr(slots, "Sampler", Recorded)
    made, texts = [], []   # each request's constraint, and the text of the tokens it read
    maker = bench_serving.constraint_maker

    def spy(kind, tokenizer):
        make = maker(kind, tokenizer)
        if make is None:
            return None

        def one():
            c, read, i = make(), [], len(texts)
            texts.append("")
            inner = c.read

            def reading(token):
                inner(token)
                read.append(token)
                texts[i] = tokenizer.decode(read)
            c.read = reading
            made.append(c)
            return c
        return one
    monkeypatch.setattr(bench_serving, "constraint_maker", spy)
    out = tmp_path / "sched.json"
    assert bench_serving.main(["--model", str(f32_fixture), "--reference", "--warm", "", "--batch", "",
                               "--scheduler", "2", "--sched-prompt", "9", "--sched-tokens", "5",
                               "--sched-constraint", constraint, "--receipt", str(out)]) == 0
    cell = json.loads(out.read_text())["metrics"]["scheduler"][0]
    assert cell["slots"] == 2 and len(cell["runs"]) == 2 and cell["constraint"] == constraint
    for run in cell["runs"]:
        assert all(t is not None and t > 0 for t in run["ttft_s"]) and all(1 <= g <= 5 for g in run["generated"])
    assert len(made) == (0 if constraint in ("none", "dry") else 6) and len({id(c) for c in made}) == len(made)
    assert len(samplers) == 6 and all(s.paced == (constraint != "none") for s in samplers)
    assert all(s.settings.dry == (constraint == "dry") for s in samplers)
    if constraint == "text":   # each read the tokens it allowed: lowercase words
        assert all(re.fullmatch(r"[a-z]+( [a-z]+)* ?", t) for t in texts), texts


@pytest.mark.parametrize("argv, says", [
    (["--parallel", "5"], "--parallel must be 1..4, got 5"),
    (["--parallel", "0"], "--parallel must be 1..4, got 0"),
    (["--ctx-size", "-1"], "--ctx-size must be >= 1, or 0 for the model's limit, got -1"),
    (["--port", "70000"], "--port must be 0..65535"),
    (["--queue", "-1"], "--queue must be >= 0"),
    (["--kv-incoming-ttl", "-1"], "--kv-incoming-ttl must be a finite number of seconds >= 0"),
    (["--kv-incoming-ttl", "nan"], "--kv-incoming-ttl must be a finite number of seconds >= 0"),
    (["--kv-incoming-ttl", "inf"], "--kv-incoming-ttl must be a finite number of seconds >= 0"),
    (["--kv-incoming-ttl", "soon"], "--kv-incoming-ttl"),
    (["--parallel", "two"], "--parallel"),
    (["--reasoning-format", "hidden"], "--reasoning-format"),
    (["--alias", " , "], "--alias names no model name"),
    (["--temp", "-1", "--reference", "--no-warmup"], "--temp: the value must be in [0.0, 100.0], got -1.0"),
    (["--top-p", "0", "--reference", "--no-warmup"], "--top-p: the value must be in (0.0, 1.0], got 0.0"),
    (["--temp", "nan", "--reference", "--no-warmup"], "--temp: the value must be a finite number"),
    (["-n", "-2", "--reference", "--no-warmup"], "--n-predict must be -1 (until the slot is full) or >= 0, got -2"),
    (["--top-k", "x"], "--top-k"),
    (["--api-key", ","], "--api-key / --api-key-file give no key"),
    (["--api-key-file", "/nonexistent/keys"], "--api-key-file /nonexistent/keys: No such file or directory"),
    (["--slot-save-path", "/nonexistent/saves", "--reference"], "--slot-save-path /nonexistent/saves: not a folder"),
    (["--kernel-config", "batch_invariant=2"], "kernel config batch_invariant must be an integer 0..1, got 2"),
    (["--kernel-config", "nonsense"], "--kernel-config: expected name=value"),
    (["--chat-template-file", "/nonexistent/t.jinja", "--model", "/nonexistent/m.gguf"],
     "chat template file '/nonexistent/t.jinja' cannot be read"),
])
def test_server_flags(argv, says, capsys):
    """The server's flags: each bad value one line naming it, exit 2, before anything listens
    (the folder check after the model's load: the embedded default model, the reference backend)."""
    from muse_mlx import server

    line = refused(server.main, argv, capsys)
    assert says in line, line


# ---- load_test: its flags, refused before a server starts -------------------------------------
@pytest.mark.parametrize("argv, says", [
    (["--parallel", "5"], "--parallel must be 1..4"),
    (["--parallel", "0"], "--parallel must be >= 1"),
    (["--requests", "0"], "--requests must be >= 1"),
    (["--concurrency", "-1"], "--concurrency must be >= 1"),
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--prompt-len", "0:5"], "--prompt-len: expected LO:HI with 1 <= LO <= HI"),
    (["--prompt-len", "9:3"], "--prompt-len: expected LO:HI"),
    (["--prompt-len", "a:b"], "--prompt-len: expected LO:HI (integers)"),
    (["--max-tokens=-1:3"], "--max-tokens: expected LO:HI with 0 <= LO <= HI"),
    (["--prompt-len", "1:99999999"], "does not fit a slot of"),
    (["--rss-slack", "nan"], "--rss-slack must be >= 0"),
    (["--receipt", PROC_MISSING], "does not exist"),
    (["--model", "/nonexistent/model.gguf"], "/nonexistent/model.gguf"),
])
def test_load_test_flags(argv, says, capsys):
    """tools/load_test: a bad flag is one line naming it, exit 2, and no server is started."""
    from muse_mlx.tools import load_test

    line = refused(load_test.main, argv, capsys)
    assert says in line, line

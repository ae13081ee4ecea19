"""The pinned llama.cpp's chat layer (common/chat.cpp: the template applied, the tool-call grammar,
the output parser), built from the pinned sdist as a small program and run as an oracle for
muse_mlx/chat_format.py.

`oracle()` compiles tests/chat_oracle/chat_oracle.cpp with the sdist's common/ sources (~1 minute on
two cores, once: the program is cached by the hash of the sdist and the harness) and links it to
the libllama the parity extra installed; None where the sdist, the parity extra or a C++ compiler is
missing. `ChatOracle.apply(request)` runs it on one request (chat_oracle.cpp's header says what it
takes and gives)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import tarfile
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

PINNED_SDIST = "llama_cpp_python-0.3.36.tar.gz"
ROOT = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
HARNESS = Path(__file__).parent / "chat_oracle" / "chat_oracle.cpp"
# what common_chat_templates_apply and common_chat_parse reach, and what they reach in turn
SOURCES = ["chat.cpp", "chat-auto-parser-generator.cpp", "chat-auto-parser-helpers.cpp", "chat-diff-analyzer.cpp",
           "chat-peg-parser.cpp", "peg-parser.cpp", "json-schema-to-grammar.cpp", "json-schema.cpp", "json.cpp",
           "log.cpp", "unicode.cpp", "common.cpp", "trie.cpp", "sampling.cpp", "fit.cpp", "speculative.cpp",
           "reasoning-budget.cpp", "llguidance.cpp", "ngram-cache.cpp", "ngram-map.cpp", "ngram-mod.cpp"]


def pinned_sdist() -> Path | None:
    for root in [os.environ.get("MUSE_PINNED_SDIST_DIR"), Path(__file__).parents[1] / ".pinned"]:
        if root and (Path(root) / PINNED_SDIST).exists():
            return Path(root) / PINNED_SDIST
    return None


def template() -> str | None:
    """The pinned muse-glimmer.jinja."""
    sdist = pinned_sdist()
    if sdist is None:
        return None
    with tarfile.open(sdist) as tar:
        return tar.extractfile(ROOT + "models/templates/muse-glimmer.jinja").read().decode()


def _llama_lib() -> Path | None:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    lib = Path(list(spec.submodule_search_locations)[0]) / "lib"
    return lib if (lib / "libllama.so").exists() else None


class ChatOracle:
    def __init__(self, program: Path):
        self.program = program

    def apply(self, request: dict) -> dict:
        run = subprocess.run([str(self.program)], input=json.dumps(request), capture_output=True, text=True,
                             timeout=120)
        out = json.loads(run.stdout)
        if "fatal" in out:
            raise ValueError(out["fatal"])
        return out


@lru_cache(maxsize=1)
def oracle() -> ChatOracle | None:
    from muse_mlx.tools.fixtures import cache_dir

    sdist, lib, cxx = pinned_sdist(), _llama_lib(), shutil.which("g++") or shutil.which("c++")
    if sdist is None or lib is None or cxx is None:
        return None
    digest = hashlib.sha256(sdist.read_bytes() + HARNESS.read_bytes()).hexdigest()[:16]
    out = cache_dir() / f"chat-oracle-{digest}"
    program = out / "chat_oracle"
    if program.exists():
        return ChatOracle(program)
    build = out.with_name(out.name + f".build-{os.getpid()}")
    shutil.rmtree(build, ignore_errors=True)
    build.mkdir(parents=True)
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(
            tuple(ROOT + d for d in ("common/", "include/", "ggml/include/", "vendor/nlohmann/")))
            or m.name.startswith(ROOT + "src/") and m.name.endswith(".h")]
        tar.extractall(build, members=members, filter="data")
    tree = build / ROOT
    common = tree / "common"
    info = (common / "build-info.cpp.in").read_text()
    for key, value in (("@LLAMA_BUILD_NUMBER@", "0"), ("@LLAMA_BUILD_COMMIT@", "pinned"), ("@BUILD_COMPILER@", ""),
                       ("@BUILD_TARGET@", "")):
        info = info.replace(key, value)
    (build / "build-info.cpp").write_text(info)
    sources = [HARNESS, build / "build-info.cpp", *(common / s for s in SOURCES),
               *sorted((common / "jinja").glob("*.cpp")), *sorted((common / "parsers").glob("*.cpp"))]
    flags = ["-std=c++17", "-O1", "-w", f"-I{common}", f"-I{tree / 'include'}", f"-I{tree / 'ggml/include'}",
             f"-I{tree / 'vendor'}"]

    def compile_one(i_src):
        i, src = i_src
        obj = build / f"{i:03d}.o"
        run = subprocess.run([cxx, *flags, "-c", str(src), "-o", str(obj)], capture_output=True, text=True)
        if run.returncode:
            raise RuntimeError(f"the chat oracle's {src.name} does not compile: {run.stderr[-2000:]}")
        return obj
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        objects = list(pool.map(compile_one, enumerate(sources)))
    subprocess.run([cxx, "-o", str(build / "chat_oracle"), *map(str, objects), f"-L{lib}", "-lllama", "-lggml",
                    "-lggml-base", f"-Wl,-rpath,{lib}", "-lpthread"], check=True, capture_output=True)
    out.mkdir(parents=True, exist_ok=True)
    os.replace(build / "chat_oracle", program)
    shutil.rmtree(build, ignore_errors=True)
    return ChatOracle(program)

"""The model `generate` and the server use when no --model is given: the tiny Muse Glimmer
trained on the Python 3.11 documentation (docs/tiny-model.md), shipped inside the package as a
Q8_0 GGUF quantized by the pinned llama.cpp. Nothing is downloaded or written to use it."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from .errors import MuseError

DEFAULT_MODEL = "data/muse-glimmer-tiny-q8_0.gguf"
# Its held-out pages (never trained on; tools/corpus.py), for perplexity checks.
HELD_OUT_TEXT = "data/tiny-heldout.txt"


def _packaged(name: str) -> Path:
    path = Path(str(resources.files("muse_mlx").joinpath(name)))
    if not path.is_file():
        raise MuseError(f"the package has no {name} (an install without its data files): reinstall muse-mlx")
    return path


def default_model_path() -> Path:
    return _packaged(DEFAULT_MODEL)


def held_out_text_path() -> Path:
    return _packaged(HELD_OUT_TEXT)

"""User-facing errors: each carries one line that names what was wrong.

The CLIs print `str(error)` to stderr and exit 2 for any `MuseError`; anything
else is a bug and keeps its traceback.
"""


class MuseError(Exception):
    """An error caused by the user's input (a file, a flag, a prompt), not by a bug."""


class ArtifactError(MuseError):
    """A GGUF file that breaks the muse-glimmer contract."""

    def __init__(self, path, what: str, expected: str | None = None, found: str | None = None):
        self.path, self.what, self.expected, self.found = str(path), what, expected, found
        msg = f"{self.path}: {what}"
        if expected is not None:
            msg += f": expected {expected}"
        if found is not None:
            msg += f", found {found}" if expected is not None else f": found {found}"
        super().__init__(msg)


class ContextLimitError(MuseError):
    """A sequence that would not fit the slot's context."""


class TokenizerError(MuseError):
    """A vocabulary or chat template the engine cannot build or render."""


class NonFiniteError(MuseError):
    """Logits that are not finite: never sampled from, never printed."""

    def __init__(self, position: int):
        super().__init__(f"non-finite logits at position {position}: the model's weights or activations overflow "
                         f"float32 there (a corrupt or hostile file, or a context past what the model handles)")
        self.position = position

"""The pinned llama.cpp (the parity anchor), driven through llama-cpp-python's low-level API.

Only `llama-cpp-python==0.3.36` is accepted: its vendored llama.cpp implements the
`muse-glimmer` architecture we compare against (DESIGN.md §1). Install it with the
`parity` extra. Everything here runs llama.cpp on the CPU.
"""

from __future__ import annotations

import ctypes
import os
import sys
from importlib import metadata
from pathlib import Path

import numpy as np

from ..errors import MuseError

PINNED_VERSION = "0.3.36"

# llama_ftype values (llama.h) for the lanes llama.cpp's own quantizer produces.
FTYPES = {"F16": 1, "Q8_0": 7, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18, "BF16": 32}
GGML_TYPE_F32, GGML_TYPE_F16 = 0, 1
_GGML_LOG_ERROR = 4  # ggml.h: NONE=0 DEBUG=1 INFO=2 WARN=3 ERROR=4 CONT=5

_lib = None
_log_callback = None  # keep the ctypes callback alive


def lib():
    """Import llama_cpp once, check the pin, and send llama.cpp's log to stderr for errors only."""
    global _lib, _log_callback
    if _lib is not None:
        return _lib
    try:
        version = metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        raise MuseError("llama-cpp-python is not installed; install the parity extra: "
                        "pip install -e '.[parity]'") from None
    if version != PINNED_VERSION:
        raise MuseError(f"llama-cpp-python {version} is installed; parity is pinned to {PINNED_VERSION}")
    import llama_cpp as L

    @L.llama_log_callback
    def _errors_only(level, text, user_data):
        if level == _GGML_LOG_ERROR:
            sys.stderr.write(text.decode("utf-8", "replace"))

    _log_callback = _errors_only
    L.llama_log_set(_log_callback, ctypes.c_void_p(0))
    L.llama_backend_init()
    _lib = L
    return L


def quantize(src, dst, ftype: str, threads: int | None = None) -> Path:
    """llama.cpp's own quantizer (llama_model_quantize) from a F32/F16 GGUF; atomic."""
    L = lib()
    if ftype not in FTYPES:
        raise MuseError(f"llama.cpp quantizes to {', '.join(FTYPES)}, not {ftype}")
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.tmp{os.getpid()}")
    params = L.llama_model_quantize_default_params()
    params.ftype = FTYPES[ftype]
    params.nthread = threads or os.cpu_count() or 1
    rc = L.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise MuseError(f"llama_model_quantize({src} -> {ftype}) failed with status {rc}")
    os.replace(tmp, dst)
    return dst


class LlamaCpp:
    """One llama.cpp model and context on the CPU, for teacher-forced logits and greedy decoding."""

    def __init__(self, path, n_ctx: int, kv_f32: bool = False, flash_attn: bool = True,
                 n_threads: int | None = None, n_ubatch: int = 512):
        L = self.L = lib()
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = L.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            raise MuseError(f"{path}: llama.cpp could not load the model")
        cp = L.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = cp.n_ubatch = min(n_ubatch, n_ctx)
        cp.n_seq_max = 1
        cp.type_k = cp.type_v = GGML_TYPE_F32 if kv_f32 else GGML_TYPE_F16
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cp.n_threads = cp.n_threads_batch = n_threads or os.cpu_count() or 1
        cp.no_perf = True
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            L.llama_model_free(self.model)
            raise MuseError(f"{path}: llama.cpp could not create a context")
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.n_batch = cp.n_batch

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self.L.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            self.L.llama_model_free(self.model)
            self.model = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def reset(self) -> None:
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)

    def _decode(self, tokens, start: int, want_logits: bool) -> np.ndarray | None:
        L = self.L
        out = np.empty((len(tokens), self.n_vocab), dtype=np.float32) if want_logits else None
        batch = L.llama_batch_init(self.n_batch, 0, 1)
        try:
            for a in range(0, len(tokens), self.n_batch):
                part = tokens[a:a + self.n_batch]
                batch.n_tokens = len(part)
                for i, t in enumerate(part):
                    batch.token[i] = int(t)
                    batch.pos[i] = start + a + i
                    batch.n_seq_id[i] = 1
                    batch.seq_id[i][0] = 0
                    batch.logits[i] = 1 if want_logits else int(a + i == len(tokens) - 1)
                rc = L.llama_decode(self.ctx, batch)
                if rc != 0:
                    raise MuseError(f"llama_decode failed with status {rc} at position {start + a}")
                if want_logits:
                    for i in range(len(part)):
                        ptr = L.llama_get_logits_ith(self.ctx, i)
                        out[a + i] = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
        finally:
            L.llama_batch_free(batch)
        return out

    def teacher_forced(self, tokens, prefill: int) -> np.ndarray:
        """Logits at every position: the first `prefill` tokens in one batch, then one token per step."""
        self.reset()
        tokens = [int(t) for t in tokens]
        rows = [self._decode(tokens[:prefill], 0, True)]
        for p in range(prefill, len(tokens)):
            rows.append(self._decode(tokens[p:p + 1], p, True))
        return np.concatenate(rows)

    def greedy(self, prompt, n: int) -> list[int]:
        """Greedy continuation of `n` tokens (argmax of the logits, first index on ties), no stop tokens."""
        self.reset()
        prompt = [int(t) for t in prompt]
        logits = self._decode(prompt, 0, True)[-1]
        out = []
        for i in range(n):
            token = int(np.argmax(logits))
            out.append(token)
            if i + 1 < n:
                logits = self._decode([token], len(prompt) + i, True)[0]
        return out

    def grammar_greedy(self, prompt, n: int, gbnf: str) -> list[int]:
        """Greedy continuation of at most `n` tokens under a GBNF grammar, by llama.cpp's own grammar
        sampler (llama_sampler_init_grammar, applied to each step's logits before the argmax, then
        told the token), up to the first end-of-generation token (not included)."""
        L = self.L
        grammar = L.llama_sampler_init_grammar(self.vocab, gbnf.encode(), b"root")
        if not grammar:
            raise MuseError("llama.cpp refused the grammar")
        try:
            self.reset()
            prompt = [int(t) for t in prompt]
            logits = self._decode(prompt, 0, True)[-1]
            data = (L.llama_token_data * self.n_vocab)()
            out = []
            for i in range(n):
                for t in range(self.n_vocab):
                    data[t].id, data[t].logit, data[t].p = t, float(logits[t]), 0.0
                candidates = L.llama_token_data_array(data, self.n_vocab, -1, False)
                L.llama_sampler_apply(grammar, ctypes.byref(candidates))
                masked = np.array([data[t].logit for t in range(candidates.size)], dtype=np.float32)
                token = int(data[int(np.argmax(masked))].id)
                if self.is_eog(token):
                    break
                L.llama_sampler_accept(grammar, token)
                out.append(token)
                if i + 1 < n:
                    logits = self._decode([token], len(prompt) + i, True)[0]
            return out
        finally:
            L.llama_sampler_free(grammar)

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        L = self.L
        data = text.encode("utf-8")
        cap = len(data) + 16
        buf = (L.llama_token * cap)()
        n = L.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (L.llama_token * cap)()
            n = L.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        return list(buf[:n])

    def is_eog(self, token: int) -> bool:
        return bool(self.L.llama_vocab_is_eog(self.vocab, token))

    def detokenize(self, tokens) -> bytes:
        L = self.L
        out = bytearray()
        buf = ctypes.create_string_buffer(256)
        for t in tokens:
            n = L.llama_token_to_piece(self.vocab, int(t), buf, len(buf), 0, False)
            if n < 0:
                raise MuseError(f"token {t}: piece longer than {len(buf)} bytes")
            out += buf.raw[:n]
        return bytes(out)

    # ---- the KV cache as llama.cpp holds it ------------------------------------------------
    def kv_state(self, n_layers_full: int, n_layers_swa: int) -> dict:
        """Sequence 0's K/V cells, parsed from llama_state_seq_get_data.

        The iSWA cache writes its full-attention cache, then its sliding cache
        (llama-kv-cache-iswa.cpp state_write); each is (llama-kv-cache.cpp state_write):
        u32 n_stream; per stream u32 cell_count, then per cell i32 pos, u32 n_seq_id,
        n_seq_id x i32; then u32 v_trans, u32 n_layer; per layer i32 k_type, u64 row
        bytes, the rows; then V the same way, or transposed (i32 type, u32 element
        size, u32 n_embd_v_gqa, then per channel the cells); all of it after a u32 magic
        and the i32 sequence id (llama-context.cpp state_seq_get_data). Returns
        {"full": [...], "sliding": [...]}, one {"positions", "k", "v"} per layer in
        layer order, K and V as (cells, n_kv*head_dim) float16.
        """
        L = self.L
        size = L.llama_state_seq_get_size(self.ctx, 0)
        buf = (ctypes.c_uint8 * size)()
        written = L.llama_state_seq_get_data(self.ctx, buf, size, 0)
        data = memoryview(bytes(buf[:written]))
        reader = _Reader(data)
        reader.take("<u4", 1)  # io magic (llama-context.cpp state_seq_get_data)
        if reader.scalar("<i4") != 0:
            raise MuseError("llama.cpp KV state: not sequence 0")
        out = {"full": reader.cache(n_layers_full), "sliding": reader.cache(n_layers_swa)}
        if reader.offset != len(data):
            raise MuseError(f"llama.cpp KV state: {len(data) - reader.offset} bytes left unparsed")
        return out


class _Reader:
    _F16 = 1

    def __init__(self, data: memoryview):
        self.data, self.offset = data, 0

    def take(self, fmt_dtype, count=1):
        dt = np.dtype(fmt_dtype)
        arr = np.frombuffer(self.data, dtype=dt, count=count, offset=self.offset)
        self.offset += dt.itemsize * count
        return arr

    def scalar(self, dtype):
        return int(self.take(dtype)[0])

    def cache(self, n_layers: int) -> list[dict]:
        n_stream = self.scalar("<u4")
        if n_stream != 1:
            raise MuseError(f"llama.cpp KV state: expected 1 stream, found {n_stream}")
        cells = self.scalar("<u4")
        if cells == 0:
            return [{"positions": np.zeros(0, np.int64), "k": None, "v": None} for _ in range(n_layers)]
        positions = np.empty(cells, dtype=np.int64)
        for i in range(cells):
            positions[i] = self.scalar("<i4")
            n_seq = self.scalar("<u4")
            self.take("<i4", n_seq)
        v_trans = self.scalar("<u4")
        n_layer = self.scalar("<u4")
        if n_layer != n_layers:
            raise MuseError(f"llama.cpp KV state: expected {n_layers} layers, found {n_layer}")
        layers = []
        for _ in range(n_layer):
            k_type, row = self.scalar("<i4"), self.scalar("<u8")
            if k_type != self._F16:
                raise MuseError(f"llama.cpp KV state: K type {k_type}, expected F16 ({self._F16})")
            k = self.take("<f2", cells * row // 2).reshape(cells, -1)
            layers.append({"positions": positions, "k": k})
        for layer in layers:
            v_type = self.scalar("<i4")
            if v_type != self._F16:
                raise MuseError(f"llama.cpp KV state: V type {v_type}, expected F16")
            if not v_trans:
                row = self.scalar("<u8")
                layer["v"] = self.take("<f2", cells * row // 2).reshape(cells, -1)
            else:
                self.scalar("<u4")  # element size
                n_embd_v = self.scalar("<u4")
                layer["v"] = self.take("<f2", cells * n_embd_v).reshape(n_embd_v, cells).T.copy()
        return layers

"""The engine's configuration, passed in: the kernel path's tuning values and the ops backend.

Nothing below the command line reads the environment. The geometry comes from the GGUF
(artifact.py -> geometry.Geometry); what is chosen at run time is here, frozen, so a compiled
step or a launch plan keyed on it can never see it change.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from .errors import MuseError


@dataclass(frozen=True)
class KernelConfig:
    """Tuning values of the GPU kernels (docs/kernels.md says what each moved when measured).

    ring_chunk, plane_chunk: K/V rows per split of the decode attention over a sliding ring /
        a full layer's plane (more splits: more threadgroups, shorter chains, more to combine).
    plane_splits_min: 0 = a plane's splits are always plane_chunk rows; n > 0 = halve them (down to
        ring_chunk) while the rows visible would take fewer than n splits (plan.plane_chunk: at a
        few hundred rows 128-row splits give a grid of 10 threadgroups a sequence, each a chain
        of 16 loads of 8 rows). 16: the packed step at 512-560 rows +2.9 % at one row, +2.5 % at
        two, against 0, in four interleaved passes (H200, 2abac51, ledger 2026-12-04).
    combine_warps: simdgroups merging one query head's splits; 0 = scaled with the splits (one
        per 16, 4..32).
    stream_groups: threadgroups of a streaming matvec; 0 = from the device (its multiprocessors
        times the groups that fit one by registers).
    stream_batch: rows of x one streaming matvec takes in threadgroup memory (a packed step over
        several slots; more rows are split over launches); 0 or 1 = products of several rows
        take matvec.inc.
    stream_batch_rf: rows of weights a batched streaming matvec (B > 1 rows of x) decodes per pass
        over its x in threadgroup memory (each pass reads the B rows' x once: more rows, fewer
        reads of threadgroup memory, more registers): 1, 2 or 4, lowered where the rows per step
        or the registers of a threadgroup would not allow it; 0 = the plan's (plan.STREAM_BATCH_RF).
    stream_mma: the fewest token rows (2..4; a packed step over slots) whose products take the
        tensor cores on CUDA (matvec_stream.inc's mma form: the weights as exact f16, x as two
        f16 halves, float32 accumulation); fewer rows take x_shared (float32 FMAs); 0 = never.
        2 by measurement (H200, ce66a6f, warps split between tiles: the packed step over 2
        slots 132.0 tok/s against x_shared's 122.0). Metal takes x_shared.
    mma_warps: the most warps a threadgroup of the mma form splits K's units between (the plan
        takes the count with the fewest idle, the most on a tie; never more than a
        multiprocessor's registers hold); 0 = 32.
    mma_tile_warps: the warps of the mma form that share one tile of 16 rows, splitting its units
        of K (the others take other tiles at the same time); 1 = a warp sums a tile alone, with no
        barrier; 0 = the plan's (plan.mma_split: the least work for the busiest warp); at
        or above the warps, the whole threadgroup on one tile.
    mma_pair_min_rows: with two rows of x, the fewest rows of a matrix (N) whose product takes
        the tensor cores; smaller ones keep x_shared (its two rows in one launch); 0 = every
        matrix. 1,024: every matrix but V (256 rows) on the tensor cores; the packed step at B = 2
        160.3 against 151.0 / 150.6 tok/s with 16,384 (gate|up and the LM head only), interleaved
        in one lease (H200, 21d9c99, ledger 2026-12-03).
    mma_min_rows: with three or four rows of x, the fewest rows of a matrix (N) whose product
        takes the tensor cores; smaller ones keep x_shared (as many rows a launch as
        plan.stream_batch_rows allows); 0 = every matrix. 1,024: V (256 rows) on x_shared, 6.9-8.0
        against 15.1-16.1 us a launch at B = 3-4 (H200, c202a3c, ledger 2026-12-03).
    mma_parts: the fewest parts of K (grid y, each with its own x fragments, their products
        added by one more node) of the tensor-core form, where K's whole blocks split into that
        many or more (up to plan.MMA_MAX_PARTS); else the fewest whose fragments fit threadgroup
        memory; 0 = always the fewest that fit. 6: FFN down's 19,968 in six parts (Q4_K 62 -> 43
        us, Q6_K 96 -> 81 at B = 4), o_proj's 4,096 in eight (20.5 -> 16.9), 6,656 whole; the
        packed step at B = 4 270.6 -> 282.6 tok/s (c202a3c).
    prefill_f16: the products of a chunk longer than the kernels' rows (prefill): 1 = each matrix
        dequantized to float16 and multiplied on the tensor cores, x rounded to f16 after a
        per-row power-of-two scaling (ops/gpu.f16_product); 0 = dequantized to float32 and
        multiplied in float32, the exactness lane for parity runs.
    prefill_flash: with prefill_f16 = 1 on CUDA, a chunk's attention: 2 = MLX's fused attention
        (ops/gpu.fused_attention, cuDNN's flash attention on CUDA, f16 in and out; mask="causal"
        where the keys are in position order, else an additive mask from the positions), head dims
        over 128 taking the flash kernel; 1 = the flash kernel everywhere (prefill_attention.inc:
        online softmax on the tensor cores, q and the weights rounded to f16, no score matrix);
        0 = MLX ops in float32 with the scores in memory (the exactness lane's attention, which
        prefill_f16 = 0 always takes). 2 prefilled 2,048 tokens on 32,768 at 4,818 tok/s against
        1's 3,142 on the H200 with shapes repeated from a warm-up (ledger, 2026-12-03, 2e86100);
        on shapes not seen before, 2 built a plan for each new masked shape in ~0.7-1.2 s (a
        2,600-token prompt 1.86 s against 1's 0.65) but took a 131,072-token prompt in 41.4 s against
        1's 54.7 (c63e03a), so 1 stays the default. (A rule taking the fused attention only where
        the visibility is plain causal lost on unseen shapes too, 6ff7baf; ledger.)
    prefill_layers_in_flight: a long chunk's layers the GPU may hold queued at once (each with its
        dequantized weights): 1 = each layer evaluated before the next is built; 2 = the next is
        built on the host while the GPU runs the one before (at most two layers' f16 weights, ~2.1
        GB at the pinned geometry). 2 prefilled 512 tokens 1.78x as fast as 1 on the H200
        (ledger, 2026-12-03, 714d5d5); the bits are the same.
    pinned_upload: how kvpack's restores (and the weights, with weights_staged) reach a CUDA device: 1 = each blob read into page-locked
        staging, checked there and copied by a kernel (kernels/upload.py); 0 = read into host
        memory, checked, and loaded by mx.load. Metal and the CPU share memory: unused there.
    weights_staged: how the weights reach a CUDA device: 1 = all of them in one pass through the same
        page-locked staging (with pinned_upload = 1; 16 MiB pieces read by several threads while
        the GPU copies earlier ones) before the model is built; 0 = mx.load, 16 MiB pieces a matrix
        at a time. 1 loaded the bench file's weights in 4.44 / 3.14 s against 0's 6.44 / 7.04 in
        `generate --max-tokens 1` (H200, 6ff7baf; ledger, 2026-12-03).
    batch_invariant: 1 = a decode step computes each sequence's logits with the same bits
        whatever else is in its batch (1..4 slots at any depths; docs/kernels.md "Batch
        invariance"): every product of 1..4 rows takes one form at every row count (the
        tensor-core form on CUDA where it applies, its parts of K added in order; else
        matvec.inc), a plane's attention splits are always plane_chunk rows, and the combine's
        simdgroups are fixed (combine_warps, or 16). 0 = each row count takes its fastest form
        (one row streams, several take the tensor cores), so a sequence's sums depend on its
        batch. Not yet measured on a GPU (ledger, 2026-12-05).
    """

    ring_chunk: int = 32
    plane_chunk: int = 128
    plane_splits_min: int = 16
    combine_warps: int = 0
    stream_groups: int = 0
    stream_batch: int = 4
    stream_batch_rf: int = 0
    stream_mma: int = 2
    mma_warps: int = 0
    mma_tile_warps: int = 0
    mma_pair_min_rows: int = 1024
    mma_min_rows: int = 1024
    mma_parts: int = 6
    prefill_f16: int = 1
    prefill_flash: int = 1
    prefill_layers_in_flight: int = 2
    pinned_upload: int = 1
    weights_staged: int = 1
    batch_invariant: int = 0

    def __post_init__(self):
        limits = {"ring_chunk": (1, 65536), "plane_chunk": (1, 65536), "plane_splits_min": (0, 1024),
                  "combine_warps": (0, 32),
                  "stream_groups": (0, 1 << 20), "stream_batch": (0, 4),
                  "stream_batch_rf": (0, 4), "stream_mma": (0, 4), "mma_warps": (0, 32), "mma_tile_warps": (0, 32),
                  "mma_pair_min_rows": (0, 1 << 24), "mma_min_rows": (0, 1 << 24), "mma_parts": (0, 8),
                  "prefill_f16": (0, 1), "prefill_flash": (0, 2), "prefill_layers_in_flight": (1, 2),
                  "pinned_upload": (0, 1), "weights_staged": (0, 1),
                  "batch_invariant": (0, 1)}
        for name, (lo, hi) in limits.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
                raise MuseError(f"kernel config {name} must be an integer {lo}..{hi}, got {value!r}")
        if self.stream_mma == 1:
            raise MuseError("kernel config stream_mma must be 0 (never) or 2..4 rows, got 1 (one row keeps x in registers)")
        if self.stream_batch_rf & (self.stream_batch_rf - 1):
            raise MuseError(f"kernel config stream_batch_rf must be 0, 1, 2 or 4, got {self.stream_batch_rf}")

    @classmethod
    def parse(cls, text: str, batch_invariant: bool = False) -> "KernelConfig":
        """From 'name=value,name=value' (the --kernel-config flag); unnamed fields keep their defaults.
        batch_invariant: the --batch-invariant flag, which sets that field to 1."""
        names = {f.name for f in fields(cls)}
        values = {}
        for item in (p.strip() for p in text.split(",")):
            if not item:
                continue
            name, eq, value = item.partition("=")
            if not eq or name not in names:
                raise MuseError(f"--kernel-config: expected name=value with name one of {', '.join(sorted(names))}, "
                                f"got {item!r}")
            try:
                values[name] = int(value)
            except ValueError:
                raise MuseError(f"--kernel-config: {name} must be an integer, got {value!r}") from None
        if batch_invariant:
            values["batch_invariant"] = 1
        return replace(cls(), **values)

    @classmethod
    def parse_tagged(cls, text: str, flag: str) -> list[tuple[str, "KernelConfig"]]:
        """'tag:name=value,...;tag2:...' -> [(tag, KernelConfig)] (several configurations compared in
        one run; 'tag:' alone is the defaults); `flag` names the option in errors."""
        out = []
        for item in filter(None, (i.strip() for i in text.split(";"))):
            tag, colon, config = item.partition(":")
            if not colon or not tag:
                raise MuseError(f"{flag}: {item!r} needs a tag, 'tag:name=value,...'")
            out.append((tag, cls.parse(config)))
        return out


BACKENDS = ("auto", "gpu", "reference")

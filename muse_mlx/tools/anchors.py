"""Numbers the project quotes rather than derives: the pinned artifact and the book's measurements.

Each is an input to a derivation, labelled with where it comes from. Derived
quantities (parameter counts, KV bytes, FLOPs) are computed from `Geometry`, never
stored here.
"""

# Seed 002 (ch. 1) §1.3 step 2: the pinned kquant GGUF's size on disk.
PINNED_ARTIFACT_BYTES = 16_756_681_056

# Seed 002 §1.3 step 5: the book's measured kquant decode throughput on the M3 Ultra
# (5 reps, CV 0.037 %). Quoted here to reproduce the book's arithmetic; not our measurement.
BOOK_DECODE_TOK_S = 35.439527527

# Seed 002 §1.3 step 5: the M3 Ultra's "~800 GB/s" memory class (a class label, not a measurement).
BOOK_M3_ULTRA_CLASS_GBPS = 800.0

# Seed 000 (ch. 22) §22.7: the measured deep-handoff payload at 130,815 tokens.
BOOK_HANDOFF_DEPTH = 130_815
BOOK_HANDOFF_BYTES = 1_823_184_896

# DESIGN.md §5: H200 HBM read bandwidth measured 2026-11-29 (one run).
H200_HBM_READ_GBPS = 4_433.0

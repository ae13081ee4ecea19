"""The float64 oracle, for the tests: it lives in muse_mlx/tools/oracle.py (the parity tool's
referee uses it too); this name keeps the tests' imports short."""

from muse_mlx.tools.oracle import (F16_EPS, ReferenceModel, attention_ref, log_softmax, position_errors,
                                   prefill_attention_ref, within_float32_noise, within_precision_noise)

__all__ = ["F16_EPS", "ReferenceModel", "attention_ref", "log_softmax", "position_errors", "prefill_attention_ref",
           "within_float32_noise", "within_precision_noise"]

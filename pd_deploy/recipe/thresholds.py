"""gsm8k's passing score per model, as InferenceX grades it (its ``utils/evals/thresholds.yaml``,
read 2026-12-03: a model prefix's own entry, else the default). Both of lm-eval's gsm8k
filters, strict-match and flexible-extract, must score at least this; equal passes. A
recipe's ``benchmark.gsm8k.threshold`` overrides it."""

from __future__ import annotations

from pd_deploy.recipe.schema import BenchmarkSpec

DEFAULT_GSM8K = 0.90
GSM8K = {"dsr1": 0.91, "dsv4": 0.91, "glm5": 0.94, "glm5.1": 0.93, "gptoss": 0.91, "kimik2.5": 0.90,
         "minimaxm2.5": 0.92, "qwen3.5": 0.94}


def gsm8k_threshold(b: BenchmarkSpec) -> tuple[float, str]:
    """(threshold, where it comes from)."""
    if b.gsm8k is not None and b.gsm8k.threshold is not None:
        return b.gsm8k.threshold, "the recipe's benchmark.gsm8k.threshold"
    prefix = b.entry.model_prefix
    if prefix in GSM8K:
        return GSM8K[prefix], f"InferenceX's threshold for {prefix}"
    return DEFAULT_GSM8K, f"InferenceX's default ({prefix} has no threshold of its own)"

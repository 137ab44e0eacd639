"""Metric sinks: the run's `metrics.jsonl`, TensorBoard, the console, W&B, and the plots drawn from them.

Nothing is imported here so that `import megarl.tracking` stays cheap.
"""

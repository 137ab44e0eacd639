"""The commands other than `megarl train`, built from the controller's parts: `megarl warmup` (a
recipe's SFT warm-up alone) and `megarl train-rm` (a reward model fitted to preference pairs).

Nothing is imported here so that `import megarl.commands` stays cheap.
"""

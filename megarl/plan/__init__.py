"""`megarl plan`: a recipe's memory per GPU, KV cache, phase peaks, step times and verdict, from config.json alone.

`params` counts what a rank holds under Megatron's sharding, `memory` turns that
into bytes (weights, gradients, optimizer state, activations), `kv_cache` sizes
SGLang's pool, `timing` estimates the phases, `gpus` names the devices, `plan`
puts a recipe together and searches the largest micro-batch and smallest TP that
fit, `report` writes it in the benchmark report format, `command` is the CLI.
"""

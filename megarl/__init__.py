"""megarl: RL post-training for LLMs on Megatron-core engines and an SGLang rollout fleet.

Importing the package is cheap: no submodule that pulls in torch, megatron,
ray or sglang is imported here.
"""

__version__ = "0.1.0"

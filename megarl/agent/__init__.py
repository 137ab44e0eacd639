"""Agentic RL: multi-turn rollouts in which the model calls tools and acts in environments.

Light to import (no torch): the sandbox workers import `megarl.agent.tools` from here.
"""

"""The built-in environments (registered by `megarl.agent.environments`)."""

"""Ray: the cluster a run starts or joins, resource pools and placement, worker groups, the engine worker
(one rank of a training engine as a Ray actor), the rollout fleets' hosts and the colocated memory cycle.

The only package that knows placement groups and GPU ids. Nothing is imported here so
that `import megarl.cluster` does not import Ray.
"""

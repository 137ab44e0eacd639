"""Launching megarl jobs on Slurm and on one machine: `megarl submit` and what runs inside the job.

Submit side (on the login node): `fit` checks a recipe's placement against the
allocation asked for, `freeze` writes the resolved recipe and the megarl sources
into the run dir, `render` writes the job script from the templates in `slurm/`,
`slurm` calls sbatch/squeue/sacct/scontrol/scancel, `command` is the verb.
Job side (on every node, as `python -m megarl.submit.<module>`): `preflight`
(devices, ports, versions, the node's address, head reachable), `registration`
(wait until every node joined Ray), `local` (launch/local.sh); the port block
comes from `megarl.cluster.ray_ports`, the shielded Ray node from
`megarl.processes`. Sits between the controller and the CLI, and imports Ray only
inside the job-side functions. Nothing is imported here, so the CLI parser and the
job-side helpers stay cheap.
"""

"""Launching megarl jobs on Slurm and on one machine: `megarl submit` and what runs inside the job.

Submit side (on the login node): `fit` checks a recipe's placement against the
allocation asked for, `render` writes the job script from the templates in
`slurm/`, `slurm` calls sbatch/squeue/scontrol/scancel, `command` is the verb.
Job side (on every node, as `python -m megarl.submit.<module>`): `ray_ports`
(the job's port block), `preflight` (devices, ports, versions, head reachable),
`registration` (wait until every node joined Ray), `local` (launch/local.sh).
Sits between the controller and the CLI; imports only megarl.config,
megarl.errors and megarl.ports, and Ray only inside the job-side functions.
Nothing is imported here, so the CLI parser and the job-side helpers stay cheap.
"""


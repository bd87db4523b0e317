"""Jobs: their shape, how a host runs them (a direct process group or Slurm, scheduler.py), groups of hosts,
logs, and a start that is whole or nothing."""

"""The agent's side of live healing (layer 5, beside ``heal`` and ``lifecycle``): its rules (``rules``), one host's
spawner (``host``), Slurm's (``slurm``) and the standby a spare node runs (``standby``). Map: ``ddpkit.live``."""

"""How a ddpkit process is started, told to stop and leaves: what the agent tells its workers
(``worker_context``), why a run stopped (``stopping``), the exit without the interpreter's teardown (``exiting``).

No torch, nothing of ddpkit above the basement.
"""

"""Live healing (``--heal live``), one wing: a lost rank replaced while the others keep their processes, the state
taken from a live peer's memory, the replicas verified. Its map, both sides of the process boundary:

===============================  =====  ==============================================================================
module                           layer  what it holds
===============================  =====  ==============================================================================
``live.protocol``                1      the agent's store, read and written as one typed ``LiveStore`` (a method a
                                        message) and its key table: a rank's registration, its question and the
                                        agent's answer, the plan of a generation, joined, first step, replicas that
                                        differ, a rank the watch named hung, a standby's slot
``live.rank.group``              3      a rank's ``LiveGroup``: ask the agent whether a peer was lost (no exception's
                                        text is read), meet the other survivors in the generation's store, re-form
                                        the group, exchange the state, ``verify`` the replicas' digests
``live.rank.unblock``            3      a survivor blocked in a collective with ranks whose node went silent (no
                                        reset comes) shuts its own connections to their hosts once the agent's plan
                                        stood a moment: the collective fails as for a killed peer
``live.rank.replica``            3      ``Replica(model, optimizer, *stateful)`` for a user's script (imported as
                                        ``ddpkit.run.live``)
``live.agent.rules``             5      ``LiveAgent``: its rules as a table (its docstring), one loop for every
                                        spawner: ranks lost together replaced in one generation, only where every
                                        survivor holds a live group; questions answered; hung ranks ended; heals and
                                        divergence handed to the attempt's ledger
``live.agent.proc``              5      a rank as the agent sees it: its process (``Proc``), what its host's kernel
                                        says of it (``Seen``), its notes, its variables
``live.agent.session``           5      one attempt for every spawner: the store, the stop marks, the signals taken
                                        and forwarded, each rank's variables, the end (a ``Spawner`` starts ranks)
``live.agent.host``              5      one host: each rank a process context forked by torch's ``start_processes``
``live.agent.slurm``             5      Slurm: each rank an srun step, P standbys on each spare node (a lost node's
                                        ranks replaced together on one)
``live.agent.hosts``             5      across hosts without Slurm: the agent on the endpoint's host, each host's
                                        member and its ranks as the agent sees them (``heal.live_hosts`` runs the
                                        attempts)
``live.agent.member``            5      a host's member: forks the ranks the agent gives it, says their start, end
                                        and state
``live.agent.wire``              5      the one connection between the agent and a member (JSON lines)
``live.agent.standby``           5      the standby's wait for its rank (``python -m ddpkit.standby`` runs it)
``live.agent.pulse``             5      under Slurm, a rank's eyes on its node: the kernel's state of its process,
                                        every 0.25 s, into the agent's store (``Seen``)
===============================  =====  ==============================================================================

Outside the wing, by design: what ``train``'s ``Trainer`` hands over (``ddpkit.train.live``, the trainer's own
state), the watch's naming of a hung rank (``ddpkit.watch.actions``) and letting go of a re-formed group
(``ddpkit.watch.regroup``), the ledger's records (``ddpkit.rundir.ledger``: ``RankReplaced``, ``ReplicasDiverged``),
and the attempt loop that hears of each heal through the hook it hands its backend (``Adapter.start``'s
``heard``: ``ddpkit.heal.attempts``). The layers are
the house's (docs/architecture.md): the rank's side sits below the commands that use it, the agent's above the
launcher it extends.
"""

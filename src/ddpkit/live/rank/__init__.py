"""A rank's side of live healing (layer 3, beside ``comm`` and ``watch``): the group re-formed in the same process
and the state handed over (``group``), and the user's ``Replica`` (``replica``). Map: ``ddpkit.live``."""

"""Judging what was measured: a check's outcomes, node facts judged across nodes and against a baseline,
baseline files, and the remedies (the commands that take a bad host out).

No torch; imported by check, bench, train's reports and ``ddpkit report``.
"""

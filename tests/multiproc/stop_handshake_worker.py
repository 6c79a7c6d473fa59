"""A worker for ``test_stop_handshake``, started by ddpkit's launcher (torch's agent): rank 1 fails once rank 0 is
ready; rank 0 waits for the SIGTERM its agent then sends (torch's agent stops the others after a failure) and writes
what it read from the agent's stop directory, with no grace to speak of: it waits for the agent's word as long as it
must (torch's agent kills it 30 s after its SIGTERM, and then nothing is written)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from ddpkit.process.stopping import signal_from_outside


def main() -> int:
    out = sys.argv[1]
    ready = out + ".ready"
    if os.environ["RANK"] == "1":  # fails once rank 0 listens for its SIGTERM (before that, the signal would kill it)
        deadline = time.monotonic() + 60
        while not os.path.exists(ready) and time.monotonic() < deadline:
            time.sleep(0.05)
        return 1
    got: list[str] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signal.Signals(signum).name))
    open(ready, "w").close()
    deadline = time.monotonic() + 60
    while not got and time.monotonic() < deadline:
        time.sleep(0.05)
    outside = signal_from_outside(got[0] if got else None, os.environ.get("DDPKIT_STOP_DIR"), grace=600)
    with open(out, "w") as f:
        json.dump({"received": got, "outside": outside}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())

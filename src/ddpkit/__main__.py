import sys

from ddpkit.cli import main

sys.exit(main())

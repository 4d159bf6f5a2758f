"""``python -m dsv4_sm120.patching``: the patch tool's command line (:mod:`.cli`)."""

import sys

from dsv4_sm120.patching.cli import main

sys.exit(main())

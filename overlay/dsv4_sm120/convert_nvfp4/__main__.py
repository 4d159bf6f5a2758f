"""``python -m dsv4_sm120.convert_nvfp4``: the converter's command line (:func:`dsv4_sm120.convert_nvfp4.cli.main`)."""

import sys

from dsv4_sm120.convert_nvfp4.cli import main

sys.exit(main())

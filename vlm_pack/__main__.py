"""``python -m vlm_pack``: the ``vlm-pack`` command line."""

import sys

from vlm_pack.cli.main import main

sys.exit(main())

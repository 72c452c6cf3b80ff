"""``python -m cluster.bench.soak``: the soak's command line (``driver.main``)."""

import sys

from cluster.bench.soak.driver import main

sys.exit(main())

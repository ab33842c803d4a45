"""`python -m rlhf_local {build|up|down|status}`: see rlhf_local.cluster."""

import sys

from rlhf_local.cluster import main

sys.exit(main())

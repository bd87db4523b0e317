"""`python -m kimi_eagle_host.ops.preflight`: the pre-flight checks of a pipeline step on its host."""

import sys

from kimi_eagle_host.ops.preflight.cli import main

sys.exit(main())

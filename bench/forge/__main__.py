"""`python -m bench.forge DEST ...` (or `python bench/forge DEST ...`): see `bench.forge.cli`."""

import os
import sys

if not __package__:  # run as a folder (python bench/forge): import from the repository instead
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.forge.cli import main  # noqa: E402

sys.exit(main())

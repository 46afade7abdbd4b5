"""``python -m hf_ftpipe``: the ``hf-ftpipe`` command line."""

import sys

from hf_ftpipe.cli.parser import main

sys.exit(main())

"""``python -m kfp_pytorch.cli``: the ``kfp-pytorch`` command."""
import sys

from kfp_pytorch.cli import main

sys.exit(main())

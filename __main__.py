"""``python -m kfp_pytorch``: the ``kfp-pytorch`` command where the environment's ``bin`` is not on
``PATH``, as in a notebook kernel started from it (``!{sys.executable} -m kfp_pytorch run ...``)."""
import sys

from kfp_pytorch.cli import main

if __name__ == "__main__":
    sys.exit(main())

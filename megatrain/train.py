"""The rank command: ``torchrun --nproc-per-node N -m megatrain.train --config X [k=v ...]``, or
``python -m megatrain.train`` for one process (``megatrain train`` is the same). What a rank does
is ``megatrain/training/rank.py``; this name stays put because launch scripts and images use it."""

import sys

from megatrain.training.rank import main

if __name__ == "__main__":
    sys.exit(main())

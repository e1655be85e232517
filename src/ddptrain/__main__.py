"""`python -m ddptrain ...`, which is also what `torchrun -m ddptrain` runs."""

from ddptrain.cli import main

raise SystemExit(main())

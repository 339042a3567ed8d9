"""``python -m torchgraft``: the same command line as the ``torchgraft`` script."""

from torchgraft.cli import main

raise SystemExit(main())

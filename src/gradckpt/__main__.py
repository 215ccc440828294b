"""``python -m gradckpt``: the same as the ``gradckpt`` command."""

from gradckpt.cli import main

raise SystemExit(main())

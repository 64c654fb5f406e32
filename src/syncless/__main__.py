"""Run the ``syncless`` command line: ``python -m syncless``."""

from syncless.cli import main

raise SystemExit(main())

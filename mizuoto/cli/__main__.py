"""`python -m mizuoto.cli ...`, the same as the `mizuoto` command."""

import sys

from mizuoto.cli.main import main

sys.exit(main())

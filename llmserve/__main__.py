"""`python -m llmserve` runs the command line."""

from llmserve.cli import main

raise SystemExit(main())

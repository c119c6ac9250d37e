"""`python -m llmserve` runs the command line."""

try:
    from llmserve.cli import main
except KeyboardInterrupt:  # Ctrl-C while importing: the same quiet 130 as main() returns
    raise SystemExit(130) from None

raise SystemExit(main())

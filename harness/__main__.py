import sys

try:
    from harness.cli import main
except KeyboardInterrupt:  # Ctrl-C while torch imports (the first seconds): one line, not its traceback
    print("interrupted while starting; nothing was measured", file=sys.stderr)
    sys.exit(130)

sys.exit(main())

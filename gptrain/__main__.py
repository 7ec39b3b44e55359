import sys

try:
    from gptrain.cli import console_main
except KeyboardInterrupt:  # Ctrl-C while the modules load: one line, no traceback
    print("gptrain: interrupted by SIGINT during start-up; nothing was written", file=sys.stderr)
    raise SystemExit(130) from None

console_main()

"""`python -m mmhandoff ...` is the `mmhandoff` command."""

from mmhandoff.serve.cli import main

if __name__ == "__main__":
    raise SystemExit(main())

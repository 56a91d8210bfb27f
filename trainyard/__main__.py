"""``python -m trainyard``: the same as the ``trainyard`` command."""

from trainyard.cli import main

if __name__ == "__main__":
    main()

"""``python -m lightning_balanced``: the ``lightning-balanced`` command."""

from lightning_balanced.cli import main

if __name__ == "__main__":
    main()

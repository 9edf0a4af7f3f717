"""steadydiff: stable, fast-converging diffusion training, measured."""

__version__ = "0.1.0"

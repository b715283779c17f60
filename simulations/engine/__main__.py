"""``python -m simulations.engine`` (also under ``torchrun ... -m simulations.engine``)."""

from .run import main

if __name__ == "__main__":
    main()

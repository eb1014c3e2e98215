"""evalkit's Hydra sweeper, ``hydra/sweeper=evalkit``: Hydra takes plugins from this package only (the code is
:mod:`evalkit.run.sweeper`)."""

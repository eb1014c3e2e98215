"""The class Hydra instantiates for ``hydra/sweeper=evalkit`` (conf/hydra/sweeper/evalkit.yaml), the sweeper the
presets of conf/experiment/ select: Hydra's basic sweeper less the jobs that cannot run (:mod:`evalkit.run.sweeper`
decides which). Hydra instantiates a sweeper only from a class of the hydra_plugins package.

Hydra's start runs its core plugins' modules again (a new BasicSweeper class) and then this one, so the class is made
here, over the basic sweeper of the moment: one made over an earlier BasicSweeper fails in its ``__init__``."""

from hydra._internal.core_plugins import basic_sweeper

from evalkit.run import sweeper


class EvalkitSweeper(basic_sweeper.BasicSweeper):
    """The basic sweeper, launching only the jobs whose config a job's own start would not refuse."""

    def split_arguments(self, overrides, max_batch_size):  # the basic sweeper's staticmethod, here with the config
        return sweeper.batches(self.config, overrides, max_batch_size, self.hydra_context.config_loader)
